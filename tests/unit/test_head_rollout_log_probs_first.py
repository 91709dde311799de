"""A rollout of several optimizer steps takes every step's log-prob passes before its first step, as
slime computes the old (and reference) log-probs once per rollout: a later step's importance ratio
is then against the policy that generated the rollout, not the weights the previous step left.
R2 routing replay is the exception: its pass records the routing the next step replays, so it runs
right before each step. The pool drives fake ranks here (no processes)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_train_rank_work import groups

from tether.config import resolve
from tether.run.train_data_hooks import load_train_data_hooks
from tether.run.trainer_pool import TrainerPool
from tether.train.rank.protocol import LogProbsRequest, LogProbsResult, TrainRequest, TrainResult, WorkerInfo


class FakeRank:
    """Records the calls the pool makes, in order; the log-prob it returns is the number of optimizer
    steps taken so far, so the test sees which weights each pass would have used."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.steps = 0

    async def compute_log_probs(self, request: LogProbsRequest) -> LogProbsResult:
        self.calls.append(f"log_probs:{request.model}")
        n = int(request.shard.loss_masks.size)
        return LogProbsResult(log_probs=np.full(n, -float(self.steps), dtype=np.float32))

    async def train(self, request: TrainRequest) -> TrainResult:
        old = request.shard.old_log_probs
        assert old is not None
        self.calls.append(f"train(old={-float(old[0]):g})")
        self.steps += 1
        return TrainResult(metrics={"loss": 0.0})


def pool_of(*flags: str) -> tuple[TrainerPool, list[str]]:
    cfg = resolve(["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", *flags])
    pool = TrainerPool.__new__(TrainerPool)  # the training logic only: no supervisor, no processes
    calls: list[str] = []
    pool.cfg, pool.critic, pool.role, pool.steps_done = cfg, None, "actor", 0
    pool.ranks = [FakeRank(calls)]  # type: ignore[list-item]
    pool.infos = [WorkerInfo(rank=0, world_size=1, initialized=True)]
    pool._train_data_hooks = load_train_data_hooks(cfg)
    pool.checks = None
    return pool, calls


def test_every_steps_old_log_probs_come_from_the_weights_before_the_rollout() -> None:
    pool, calls = pool_of("--global-batch-size", "4")  # 8 samples: two steps per rollout
    asyncio.run(pool.train(0, groups(4), weight_version=1))
    assert calls == ["log_probs:actor", "log_probs:actor", "train(old=0)", "train(old=0)"]
    assert pool.steps_done == 2


@pytest.mark.parametrize("flags", [("--use-routing-replay",)])
def test_r2_routing_replay_records_each_steps_routing_right_before_it(flags: tuple[str, ...]) -> None:
    pool, calls = pool_of("--global-batch-size", "4", *flags)
    asyncio.run(pool.train(0, groups(4), weight_version=1))
    assert calls == ["log_probs:actor", "train(old=0)", "log_probs:actor", "train(old=1)"]

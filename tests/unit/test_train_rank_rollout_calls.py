"""One hand-over per rollout (tether.train.rank.rollout_calls): the head gives train/ a rollout's
groups once and only dispatches the calls that come back, one per collective pass, answering each
with one result per DP rank. Driven here with answers built by the test, no ranks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from test_train_rank_work import groups

from tether.train.config import AlgorithmConfig
from tether.train.rank.protocol import LogProbsResult, TrainResult, ValuesResult
from tether.train.rank.rollout_calls import (
    Calls,
    LogProbsCall,
    RankCall,
    StepMetricOptions,
    TrainCall,
    Trained,
    ValuesCall,
    actor_calls,
    critic_calls,
)
from tether.train.rank.work import WorkOptions


def answer(call: RankCall, step: int) -> list:  # type: ignore[type-arg]
    """One result per DP rank, shaped as the rank would answer; log-probs and values carry `step`
    (the optimizer steps taken before the call), so the test sees which weights a pass used."""
    match call:
        case LogProbsCall(requests):
            return [
                LogProbsResult(log_probs=np.full(int(r.shard.loss_masks.size), -float(step), np.float32))
                for r in requests
            ]
        case TrainCall(requests):
            return [TrainResult(metrics={"loss": float(step)}) for _ in requests]
        case ValuesCall(requests):
            return [
                ValuesResult(values=np.full(int(r.shard.loss_masks.size), 0.5, np.float32)) for r in requests
            ]
    raise AssertionError(call)


def drive(calls: Calls) -> tuple[list[RankCall], Trained]:
    seen: list[RankCall] = []
    steps = 0
    results = None
    while True:
        try:
            call = calls.send(results)  # type: ignore[arg-type]
        except StopIteration as done:
            return seen, done.value
        seen.append(call)
        results = answer(call, steps)
        steps += isinstance(call, TrainCall)


def kinds(seen: list[RankCall]) -> list[str]:
    return [
        f"log_probs:{c.requests[0].model}" if isinstance(c, LogProbsCall) else type(c).__name__ for c in seen
    ]


def test_the_actor_takes_every_steps_log_probs_before_its_first_step_then_steps_in_order() -> None:
    seen, trained = drive(
        actor_calls(groups(4), 5, AlgorithmConfig(), WorkOptions(global_batch_size=4), dp_size=2)
    )
    assert kinds(seen) == ["log_probs:actor", "log_probs:actor", "TrainCall", "TrainCall"]
    assert all(len(c.requests) == 2 for c in seen)  # one request per DP rank
    train = [c for c in seen if isinstance(c, TrainCall)]
    assert [[(r.rollout_id, r.first_of_rollout, r.last_of_rollout) for r in c.requests] for c in train] == [
        [(5, True, False)] * 2,
        [(5, False, True)] * 2,
    ]
    for c in train:  # the second step's old log-probs are still the rollout's weights' (step 0)
        assert all(float(r.shard.old_log_probs.max()) == 0.0 for r in c.requests)  # type: ignore[union-attr]
    assert trained.steps == 2 and trained.metrics["train/loss"] == 1.0  # the last step's
    assert [len(s) for s in trained.shards] == [2, 2]


def test_r2_routing_replay_runs_each_steps_log_prob_pass_right_before_it() -> None:
    seen, _ = drive(
        actor_calls(
            groups(4),
            0,
            AlgorithmConfig(use_routing_replay=True),
            WorkOptions(global_batch_size=4),
            dp_size=1,
        )
    )
    assert kinds(seen) == ["log_probs:actor", "TrainCall", "log_probs:actor", "TrainCall"]
    second = seen[3]
    assert isinstance(second, TrainCall)
    assert float(second.requests[0].shard.old_log_probs.max()) == -1.0  # type: ignore[union-attr]


def test_one_on_policy_step_is_one_call_and_reports_correct_samples_when_asked() -> None:
    seen, trained = drive(
        actor_calls(
            groups(4),
            0,
            AlgorithmConfig(),
            WorkOptions(global_batch_size=8),
            dp_size=2,
            metric_options=StepMetricOptions(correct_samples_max_len=16),
        )
    )
    assert kinds(seen) == ["TrainCall"]
    assert "rollout/correct_length/p25" in trained.metrics, trained.metrics


def test_the_critic_computes_values_first_then_steps_and_hands_back_the_values() -> None:
    samples = groups(4)
    seen, trained = drive(
        critic_calls(
            samples,
            2,
            AlgorithmConfig(advantage_estimator="ppo"),
            WorkOptions(global_batch_size=4),
            dp_size=2,
        )
    )
    assert kinds(seen) == ["ValuesCall", "TrainCall", "TrainCall"]
    n_tokens = sum(s.response_length for g in samples for s in g)
    assert trained.values is not None and trained.values.shape == (n_tokens,)
    assert np.all(trained.values == 0.5)
    assert trained.steps == 2 and "train/critic-loss" in trained.metrics


class Recorder:
    """A StepChecks that records where it was called from, and what with."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def rollout_data(self, rollout_id: int, metrics: Mapping[str, float]) -> None:
        self.calls.append(("rollout_data", rollout_id, dict(metrics)))

    def step(
        self, role: str, rollout_id: int, step_id: int, steps_per_rollout: int, metrics: Mapping[str, float]
    ) -> None:
        self.calls.append(("step", role, rollout_id, step_id, steps_per_rollout, dict(metrics)))


def test_checks_see_the_rollouts_log_probs_before_training_and_every_steps_metrics() -> None:
    # The reference pass too (--use-kl-loss): the actor's pass answers -0.0 (no step yet), as does
    # the reference's; both land in the checks and in the rollout's metrics, as slime logs them.
    rec = Recorder()
    seen, trained = drive(
        actor_calls(
            groups(4),
            3,
            AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1),
            WorkOptions(global_batch_size=4),
            dp_size=2,
            checks=rec,
        )
    )
    assert kinds(seen) == ["log_probs:actor", "log_probs:ref"] * 2 + ["TrainCall", "TrainCall"]
    data = {"rollout/log_probs": 0.0, "rollout/ref_log_probs": 0.0}
    assert rec.calls == [
        ("rollout_data", 3, data),
        ("step", "actor", 3, 0, 2, {"loss": 0.0}),
        ("step", "actor", 3, 1, 2, {"loss": 1.0}),
    ]
    assert {k: trained.metrics[k] for k in data} == data
    rec = Recorder()
    drive(
        critic_calls(
            groups(4),
            2,
            AlgorithmConfig(advantage_estimator="ppo"),
            WorkOptions(global_batch_size=4),
            dp_size=1,
            checks=rec,
        )
    )
    assert [c[:5] for c in rec.calls] == [("step", "critic", 2, 0, 2), ("step", "critic", 2, 1, 2)]


def test_an_answer_of_the_wrong_kind_is_refused_naming_the_call() -> None:
    calls = actor_calls(groups(4), 0, AlgorithmConfig(), WorkOptions(global_batch_size=8), dp_size=1)
    call = next(calls)
    assert isinstance(call, TrainCall)
    with pytest.raises(TypeError, match="TrainCall must be TrainResults"):
        calls.send([ValuesResult(values=np.zeros(1, np.float32))])


def test_the_head_imports_torch_for_step_work_that_uses_it(tmp_path: Path) -> None:
    from tether.config import resolve
    from tether.run.trainer_pool import step_work_needs_torch

    hook = tmp_path / "hook.py"
    hook.write_text("def post(args, samples):\n    return [0.0] * len(samples), [0.0] * len(samples)\n")
    base = ["--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    assert not step_work_needs_torch(resolve(base))
    assert step_work_needs_torch(resolve([*base, "--normalize-advantages"]))
    assert step_work_needs_torch(resolve([*base, "--advantage-estimator", "ppo"]))
    assert step_work_needs_torch(resolve([*base, "--custom-reward-post-process-path", f"{hook}:post"]))

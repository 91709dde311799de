"""A rollout turned into each rank's work (tether.train.rank.work): which log-probs a step needs,
the shards and plans per data-parallel rank, and advantages before or after the log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from tether.rollout.sample import Sample
from tether.train.config import AlgorithmConfig
from tether.train.rank.work import WorkOptions, rollout_steps


def groups(n_groups: int, per_group: int = 2) -> list[list[Sample]]:
    out = []
    for g in range(n_groups):
        group = []
        for j in range(per_group):
            i = g * per_group + j
            group.append(
                Sample(
                    index=i,
                    group_index=g,
                    rollout_id=i,
                    tokens=[(i * 5 + k) % 40 + 1 for k in range(3 + 2 + i % 3)],
                    response_length=2 + i % 3,
                    loss_mask=[1] * (2 + i % 3),
                    rollout_log_probs=[-0.5] * (2 + i % 3),
                    reward=float(j),  # one right, one wrong per group: non-zero advantages
                )
            )
        out.append(group)
    return out


def test_one_on_policy_step_needs_no_log_probs_and_has_whole_step_advantages() -> None:
    steps = rollout_steps(groups(4), AlgorithmConfig(), WorkOptions(global_batch_size=8), dp_size=2)
    assert len(steps) == 1
    step = steps[0]
    assert step.log_prob_models == () and not step.needs_log_probs
    requests = step.train_requests(rollout_id=3)
    assert [r.rollout_id for r in requests] == [3, 3] and len(requests) == step.dp_size == 2
    for r in requests:
        assert r.shard.advantages is not None and r.shard.advantages.dtype == np.float32
        assert len(r.plan) >= 1  # every rank runs micro-batches
    # GRPO: within each group the right answer gets a positive advantage, the wrong one negative.
    assert sum(float(np.abs(r.shard.advantages).sum()) for r in requests) > 0


def test_several_steps_need_old_log_probs_and_refuse_training_without_them() -> None:
    steps = rollout_steps(groups(4), AlgorithmConfig(), WorkOptions(global_batch_size=4), dp_size=1)
    assert len(steps) == 2
    step = steps[1]
    assert step.log_prob_models == ("actor",) and step.needs_log_probs
    with pytest.raises(RuntimeError, match="log-probs first"):
        step.train_requests(0)
    (req,) = step.log_prob_requests("actor")
    with pytest.raises(ValueError, match="no 'ref'"):
        step.log_prob_requests("ref")
    n_tokens = int(req.shard.loss_masks.size)
    step.with_log_probs({"actor": [np.full(n_tokens, -1.0, dtype=np.float32)]})
    (train,) = step.train_requests(1)
    assert train.shard.old_log_probs is not None and train.shard.old_log_probs.tolist() == [-1.0] * n_tokens


def test_kl_shaping_computes_advantages_only_once_log_probs_arrive() -> None:
    algorithm = AlgorithmConfig(kl_coef=0.1)
    (step,) = rollout_steps(groups(2), algorithm, WorkOptions(global_batch_size=4), dp_size=2)
    assert step.log_prob_models == ("actor", "ref")
    assert all(s.advantages is None for s in step.shards)
    with pytest.raises(ValueError, match="needs"):
        step.with_log_probs({"actor": [np.zeros(1)] * 2})
    per_dp = [np.zeros(s.loss_masks.size, dtype=np.float32) for s in step.shards]
    ref = [a - 0.5 for a in per_dp]
    step.with_log_probs({"actor": per_dp, "ref": ref})
    assert all(s.advantages is not None for s in step.shards)


def test_sft_needs_no_log_probs_nor_advantages() -> None:
    algorithm = AlgorithmConfig(loss_type="sft_loss")
    steps = rollout_steps(groups(4), algorithm, WorkOptions(global_batch_size=4), dp_size=1)
    assert len(steps) == 2 and all(s.log_prob_models == () for s in steps)
    assert all(r.shard.advantages is None for s in steps for r in s.train_requests(0))


def test_balance_data_flag_reaches_the_shards() -> None:
    from tether.config import resolve

    skewed = groups(4)
    for g in skewed:  # one long response per group: round-robin puts every long one on rank 0
        g[0].tokens = g[0].tokens + [3] * 40
        g[0].response_length += 40
        g[0].loss_mask = [1] * g[0].response_length
        g[0].rollout_log_probs = [-0.5] * g[0].response_length

    def shard_tokens(argv: list[str]) -> list[int]:
        cfg = resolve(["--global-batch-size", "8", *argv])
        options = WorkOptions.from_config(cfg.data, cfg.rollout.reward_key)
        (step,) = rollout_steps(skewed, AlgorithmConfig(), options, dp_size=2)
        return [int(s.total_lengths.sum()) for s in step.shards]

    strided, balanced = shard_tokens([]), shard_tokens(["--balance-data"])
    assert sum(strided) == sum(balanced)
    assert abs(balanced[0] - balanced[1]) < abs(strided[0] - strided[1])

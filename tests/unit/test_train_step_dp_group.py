"""What every data-parallel rank sees of the whole step in slime (issue #19): advantages whitened
with the DP group's sums when they are computed per shard (on-policy distillation, KL shaping), and
the rollout-data-postprocess hook's `raw_reward` holding the whole rollout's raw rewards."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_train_rank_work import groups

from tether.train.algorithms.advantages import whiten
from tether.train.algorithms.shard_whitening import whiten_across_shards
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks
from tether.train.rank.work import StepWork, WorkOptions, rollout_steps


def test_whitening_shards_with_the_groups_sums_equals_whitening_them_together() -> None:
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=gen, dtype=torch.float64) * (1 + n) for n in (5, 3, 4)]
    masks = [torch.ones(5), torch.tensor([1.0, 0.0, 1.0]), torch.zeros(4)]  # the last: a filler copy
    calls: list[int] = []

    def shard(i: int) -> Any:
        def compute(all_reduce: Any) -> torch.Tensor:
            calls.append(i)
            return whiten(values[i], masks[i], all_reduce)

        return compute

    got = whiten_across_shards([shard(i) for i in range(3)])
    want = whiten(torch.cat(values), torch.cat(masks))
    torch.testing.assert_close(torch.cat(got), want)
    alone = whiten(values[0], masks[0])  # what each shard whitened on its own gave before
    assert not torch.allclose(got[0], alone)
    assert calls == [0, 1, 2, 0, 1, 2]  # a recording pass, then one with the group's sums
    # Nothing whitened (no --normalize-advantages): one pass; one shard: no group at all.
    assert [t.tolist() for t in whiten_across_shards([lambda ar: values[1], lambda ar: values[2]])] == [
        values[1].tolist(),
        values[2].tolist(),
    ]
    assert whiten_across_shards([lambda ar: ar]) == [None]


def _opd_step(dp_size: int) -> tuple[StepWork, dict[int, list[float]]]:
    """One OPD step over 6 samples (teacher log-probs on the Samples, student from the trainer)."""
    data = groups(3)
    for g in data:
        for s in g:
            s.teacher_log_probs = [-0.2 * (1 + (s.index + k) % 4) for k in range(s.response_length)]
    algorithm = AlgorithmConfig(use_opd=True, opd_type="sglang", opd_kl_coef=0.7, normalize_advantages=True)
    [step] = rollout_steps(data, algorithm, WorkOptions(global_batch_size=6), dp_size=dp_size)
    assert step.log_prob_models == ("actor",)
    student = [
        np.concatenate(
            [
                np.full(int(n), -0.3 * (1 + int(i) % 3), dtype=np.float32)
                for i, n in zip(shard.sample_indices, shard.response_lengths, strict=True)
            ]
        )
        for shard in step.shards
    ]
    step.with_log_probs({"actor": student})
    per_sample: dict[int, list[float]] = {}
    for shard in step.shards:
        ro = shard.response_offsets
        assert shard.advantages is not None
        for k in np.flatnonzero(shard.loss_weights):  # real samples, not filler copies
            per_sample[int(shard.sample_indices[k])] = shard.advantages[ro[k] : ro[k + 1]].tolist()
    return step, per_sample


@pytest.mark.parametrize("dp_size", [2, 4])  # 4: two shards hold a filler copy
def test_opd_advantages_are_whitened_over_the_whole_step_at_any_dp(dp_size: int) -> None:
    _, whole = _opd_step(1)
    _, sharded = _opd_step(dp_size)
    assert sorted(sharded) == sorted(whole) == list(range(6))
    for i in whole:
        np.testing.assert_allclose(sharded[i], whole[i], rtol=1e-5, atol=1e-6)
    tokens = np.concatenate([whole[i] for i in sorted(whole)])
    assert abs(tokens.mean()) < 1e-5 and tokens.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_postprocess_hook_sees_the_whole_rollouts_raw_reward_on_every_shard() -> None:
    data = groups(2)
    for g in data:
        for s in g:
            s.reward = 0.5 * s.index  # a raw reward per sample, told apart
    seen: list[dict[str, Any]] = []

    def hook(rollout_id: int, rollout_data: dict[str, Any]) -> None:
        seen.append({k: rollout_data[k] for k in ("raw_reward", "local_raw_reward", "sample_indices")})

    hooks = TrainDataHooks(rollout_data_postprocess=hook, rollout_data_postprocess_path="h.py:hook")
    steps = rollout_steps(data, AlgorithmConfig(), WorkOptions(global_batch_size=2), dp_size=2, hooks=hooks)
    assert len(steps) == 2  # the rollout trains in two steps; slime's raw_reward is still the rollout's
    for step in steps:
        step.with_log_probs({"actor": [np.zeros(s.loss_masks.size, np.float32) for s in step.shards]})
        step.train_requests(3)
    assert len(seen) == 4  # each step's two shards
    for call in seen:
        assert call["raw_reward"] == [0.0, 0.5, 1.0, 1.5]  # slime ships it whole to every rank
        assert call["local_raw_reward"] == [0.5 * i for i in call["sample_indices"]]  # the shard's own
    assert sorted(i for call in seen for i in call["sample_indices"]) == [0, 1, 2, 3]


def test_custom_advantage_function_sees_the_whole_rollouts_raw_reward() -> None:
    data = groups(2)
    for g in data:
        for s in g:
            s.reward = 0.5 * s.index
    seen: list[tuple[list[float], list[float]]] = []

    def advantage(rollout_data: dict[str, Any]) -> None:
        seen.append((rollout_data["raw_reward"], rollout_data["local_raw_reward"]))
        rollout_data["advantages"] = [torch.ones(n) for n in rollout_data["response_lengths"]]
        rollout_data["returns"] = rollout_data["advantages"]

    hooks = TrainDataHooks(advantage=advantage, advantage_path="h.py:advantage")
    algorithm = AlgorithmConfig(normalize_advantages=False)
    steps = rollout_steps(data, algorithm, WorkOptions(global_batch_size=2), dp_size=1, hooks=hooks)
    assert len(steps) == 2 and len(seen) == 2  # once per step, before it is sharded
    assert all(whole == [0.0, 0.5, 1.0, 1.5] for whole, _ in seen)
    assert sorted(r for _, local in seen for r in local) == [0.0, 0.5, 1.0, 1.5]  # each step's own

"""Advantage estimators against hand-computed small cases."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.train.algorithms import advantages as adv
from tether.train.config import AlgorithmConfig


def test_grpo_group_normalisation_with_and_without_std() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 2.0]
    groups = [0, 0, 0, 0, 1, 1, 2]
    got = adv.process_rewards(AlgorithmConfig(), rewards, groups)
    std0 = statistics.stdev([1.0, 0.0, 0.0, 1.0])  # sample std (n - 1), as torch.std
    expected0 = [(r - 0.5) / (std0 + 1e-6) for r in [1.0, 0.0, 0.0, 1.0]]
    assert got[:4].tolist() == pytest.approx(expected0)
    assert got[4:].tolist() == pytest.approx([0.0, 0.0, 0.0])  # equal rewards, and a group of one
    drgrpo = adv.process_rewards(AlgorithmConfig(disable_grpo_std_normalization=True), rewards, groups)
    assert drgrpo.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    raw = adv.process_rewards(AlgorithmConfig(disable_rewards_normalization=True), rewards, groups)
    assert raw.tolist() == rewards


def test_estimators_choose_their_reward_processing() -> None:
    rewards, groups = [1.0, 3.0], [0, 0]
    gspo = adv.process_rewards(AlgorithmConfig(advantage_estimator="gspo"), rewards, groups)
    assert gspo.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    base_cfg = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True)
    assert adv.process_rewards(base_cfg, rewards, groups).tolist() == [-1.0, 1.0]  # mean only, never std
    rpp = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True)
    assert adv.process_rewards(rpp, rewards, groups).tolist() == rewards


def test_grpo_broadcasts_reward_and_ignores_kl() -> None:
    out = adv.token_advantages(
        "grpo",
        rewards=torch.tensor([0.5, -1.0]),
        response_lengths=[2, 3],
        loss_mask=torch.ones(5),
        kl_coef=0.5,
        kl=torch.ones(5),
    )
    assert out.tolist() == [0.5, 0.5, -1.0, -1.0, -1.0]


def test_reinforce_plus_plus_discounted_returns_hand_case() -> None:
    # One sample, 4 response tokens, mask [1, 1, 0, 1] -> last trainable index 3; kl = [0.1, 0.2, 0.3, 0.4]
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    out = adv.token_advantages(
        "reinforce_plus_plus",
        rewards=torch.tensor([1.0]),
        response_lengths=[4],
        loss_mask=mask,
        kl_coef=0.5,
        gamma=0.9,
        kl=kl,
    )
    r = [-0.05, -0.1, 0.0, -0.2 + 1.0]  # -kl_coef * kl * mask, reward on the last trainable token
    g3 = r[3]
    g2 = r[2] + 0.9 * g3
    g1 = r[1] + 0.9 * g2
    g0 = r[0] + 0.9 * g1
    assert out.tolist() == pytest.approx([g0, g1, g2, g3])


def test_reinforce_plus_plus_baseline_subtracts_kl_per_token() -> None:
    out = adv.token_advantages(
        "reinforce_plus_plus_baseline",
        rewards=torch.tensor([2.0, -1.0]),
        response_lengths=[1, 2],
        loss_mask=torch.ones(3),
        kl_coef=0.1,
        kl=torch.tensor([1.0, 2.0, 3.0]),
    )
    assert out.tolist() == pytest.approx([1.9, -1.2, -1.3])


def test_filler_samples_get_zero_advantages() -> None:
    out = adv.token_advantages(
        "reinforce_plus_plus",
        rewards=torch.tensor([1.0, 3.0]),
        response_lengths=[2, 2],
        loss_mask=torch.tensor([1.0, 1.0, 0.0, 0.0]),
    )
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_whiten_uses_masked_unbiased_stats_and_all_reduce() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    out = adv.whiten(values, mask)
    assert out[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)  # mean 2, unbiased var 1
    # Two "ranks" holding halves: the all-reduce callback sums both ranks' statistics.
    a_vals, b_vals = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    stats_b = torch.stack([b_vals.double().sum(), (b_vals.double() ** 2).sum(), torch.tensor(1.0).double()])
    out_a = adv.whiten(a_vals, torch.ones(2), all_reduce=lambda s: s + stats_b)
    assert out_a.tolist() == pytest.approx([-1.0, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="no trainable token"):
        adv.whiten(values, torch.zeros(4))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.integers(1, 4))
def test_grpo_groups_have_zero_mean(rewards: list[float], n_groups: int) -> None:
    groups = [i % n_groups for i in range(len(rewards))]
    out = adv.group_normalize(rewards, groups, divide_by_std=True)
    for g in set(groups):
        sel = np.array(groups) == g
        assert abs(out[sel].mean()) < 1e-6


def test_compute_advantages_end_to_end_with_kl_shaping_and_whitening() -> None:
    cfg = AlgorithmConfig(
        advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True, kl_coef=0.5
    )
    lp = torch.tensor([-1.0, -1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0, -1.0])
    out = adv.compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, -1.0]),
        response_lengths=[1, 2],
        loss_mask=torch.ones(3),
        log_probs=lp,
        ref_log_probs=ref,
    )
    raw = torch.tensor([1.0 - 0.5 * 0.5, -1.0, -1.0 + 0.5])  # k1 KL = lp - ref
    mean, std = raw.mean(), raw.std()
    assert out.tolist() == pytest.approx(((raw - mean) / std).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="--kl-coef"):
        adv.compute_advantages(
            cfg, rewards=torch.tensor([1.0]), response_lengths=[1], loss_mask=torch.ones(1)
        )


@pytest.mark.parametrize("estimator", sorted(adv.REWARD_ON_EVERY_TOKEN))
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=12),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_reward_per_token_gives_compute_advantages_values_bit_for_bit(
    estimator: str, lengths: list[int], seed: int
) -> None:
    """Where `needs_torch` is False the head's numpy path must equal the torch computation exactly
    (rewards processed in float64, as process_rewards gives them)."""
    cfg = AlgorithmConfig(advantage_estimator=estimator)  # type: ignore[arg-type]
    assert not adv.needs_torch(cfg)
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=len(lengths)) * 10.0 ** rng.integers(-8, 8)
    mask = (rng.random(sum(lengths)) < 0.7).astype(np.float32)
    expected = adv.compute_advantages(
        cfg,
        rewards=torch.from_numpy(rewards.astype(np.float32)),
        response_lengths=lengths,
        loss_mask=torch.from_numpy(mask),
    )
    got = adv.reward_per_token(rewards, np.asarray(lengths), mask)
    assert got.dtype == np.float32
    assert np.array_equal(got, expected.numpy().astype(np.float32))


def test_reward_per_token_refuses_shapes_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\); expected \(2,\)"):
        adv.reward_per_token(np.zeros(3), [1, 2], np.ones(3))
    with pytest.raises(ValueError, match=r"loss_mask has shape \(4,\); expected \(3,\)"):
        adv.reward_per_token(np.zeros(2), [1, 2], np.ones(4))


@pytest.mark.parametrize(
    ("change", "needs"),
    [
        ({}, False),
        ({"advantage_estimator": "gspo"}, False),
        ({"advantage_estimator": "cispo"}, False),
        ({"disable_grpo_std_normalization": True}, False),  # reward processing is numpy either way
        ({"advantage_estimator": "ppo"}, True),
        ({"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True}, True),
        ({"advantage_estimator": "reinforce_plus_plus_baseline", "normalize_advantages": True}, True),
        ({"kl_coef": 0.1}, True),
        ({"normalize_advantages": True}, True),
        ({"use_opd": True, "opd_type": "sglang"}, True),
    ],
)
def test_needs_torch_only_beyond_copying_each_reward_onto_its_tokens(change: dict, needs: bool) -> None:  # type: ignore[type-arg]
    assert adv.needs_torch(AlgorithmConfig(**change)) is needs

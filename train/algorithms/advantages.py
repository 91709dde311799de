"""Advantage estimators with slime's names and semantics.

Two stages, as in slime:
1. `process_rewards` (on the head, over the whole rollout, where groups are complete): grpo, gspo, cispo
   and reinforce_plus_plus_baseline subtract the group mean; grpo, gspo and cispo also divide by the group std
   (unless --disable-grpo-std-normalization); --disable-rewards-normalization keeps raw rewards.
2. `token_advantages` (on the trainer, once log-probs are known): per response token.
   - grpo / gspo / cispo: the sample's (normalised) reward on every token (GSPO and CISPO differ in the
     loss: see `tether.train.algorithms.losses.sequence_mean_log_ratio` and `cispo_loss`);
   - reinforce_plus_plus: discounted returns of token rewards -kl_coef * KL (trainable tokens only)
     plus the scalar reward on the last trainable token;
   - reinforce_plus_plus_baseline: (reward - group mean) - kl_coef * KL on every token;
   - ppo: GAE (gamma, lambd) over token rewards -kl_coef * KL plus the reward on the last response
     token, with the critic's values (`tether.train.algorithms.gae`).
   Then, with --normalize-advantages, `whiten` over the step's trainable tokens across DP ranks.

grpo, gspo and cispo without KL shaping or whitening copy each reward onto its tokens, which
`reward_per_token` does in numpy: the head's step work then needs no torch (`needs_torch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tether.train.algorithms.gae import gae, ppo_token_rewards
from tether.train.config import AdvantageEstimator, AlgorithmConfig

if TYPE_CHECKING:
    import torch

GROUP_NORMALISED: frozenset[str] = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"})
STD_NORMALISED: frozenset[str] = frozenset({"grpo", "gspo", "cispo"})
REWARD_ON_EVERY_TOKEN: frozenset[str] = frozenset({"grpo", "gspo", "cispo"})


def group_normalize(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[int] | np.ndarray,
    *,
    divide_by_std: bool,
    eps: float = 1e-6,
) -> np.ndarray:
    """Subtract each group's mean reward, and divide by its sample std (n - 1) + eps if asked.

    A group of one sample has std 0 (its centred reward is 0 anyway).
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_ids)
    if r.shape != g.shape:
        raise ValueError(f"rewards has {r.size} entries but group_ids has {g.size}")
    _, inverse, counts = np.unique(g, return_inverse=True, return_counts=True)
    mean = np.bincount(inverse, weights=r) / counts
    centred = r - mean[inverse]
    if not divide_by_std:
        return centred
    sq = np.bincount(inverse, weights=centred**2)
    std = np.sqrt(np.divide(sq, counts - 1, out=np.zeros_like(sq), where=counts > 1))
    return centred / (std[inverse] + eps)


def process_rewards(
    cfg: AlgorithmConfig, raw_rewards: Sequence[float] | np.ndarray, group_ids: Sequence[int] | np.ndarray
) -> np.ndarray:
    """The rewards the estimator uses, from the verifier's, for one rollout (slime's post-processing)."""
    raw = np.asarray(raw_rewards, dtype=np.float64)
    if cfg.advantage_estimator in GROUP_NORMALISED and not cfg.disable_rewards_normalization:
        divide = cfg.advantage_estimator in STD_NORMALISED and not cfg.disable_grpo_std_normalization
        return group_normalize(raw, group_ids, divide_by_std=divide)
    return raw


def needs_torch(cfg: AlgorithmConfig) -> bool:
    """Whether `compute_advantages` is needed for `cfg` (torch), rather than `reward_per_token`."""
    return not (
        cfg.advantage_estimator in REWARD_ON_EVERY_TOKEN
        and cfg.kl_coef == 0
        and not cfg.normalize_advantages
        and not cfg.use_opd
    )


def reward_per_token(
    rewards: np.ndarray, response_lengths: Sequence[int] | np.ndarray, loss_mask: np.ndarray
) -> np.ndarray:
    """float32 per-response-token advantages where `needs_torch` is False: each sample's
    (processed) reward on every one of its tokens, the values `compute_advantages` gives then."""
    lengths = np.asarray(response_lengths, dtype=np.int64)
    r = np.asarray(rewards).astype(np.float32)
    if r.shape != lengths.shape:
        raise ValueError(f"rewards has shape {r.shape}; expected ({lengths.size},)")
    total = int(lengths.sum())
    if np.shape(loss_mask) != (total,):
        raise ValueError(f"loss_mask has shape {np.shape(loss_mask)}; expected ({total},)")
    return np.repeat(r, lengths)


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} along the last axis."""
    import torch

    out = torch.empty_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        running = token_rewards[..., t] + gamma * running
        out[..., t] = running
    return out


def token_advantages(
    estimator: AdvantageEstimator,
    *,
    rewards: torch.Tensor,
    response_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    lambd: float = 1.0,
) -> torch.Tensor:
    """Per-response-token advantages (flat, sample order) before any whitening.

    `rewards` holds one processed reward per sample; `kl` is the per-token KL(policy || ref) used for
    reward shaping (reinforce++ variants; grpo/gspo ignore it, as slime does).
    """
    import torch

    n = len(response_lengths)
    if rewards.shape != (n,):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected ({n},)")
    lengths = torch.as_tensor(list(response_lengths), device=rewards.device)
    total = int(lengths.sum())
    if loss_mask.shape != (total,):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}; expected ({total},)")
    per_token_reward = torch.repeat_interleave(rewards.float(), lengths)
    if estimator in ("grpo", "gspo", "cispo"):
        return per_token_reward
    if estimator == "ppo":
        if values is None:
            raise ValueError("advantage_estimator='ppo' needs the critic's values")
        token_rewards = ppo_token_rewards(rewards, response_lengths, kl=kl, kl_coef=kl_coef)
        return gae(token_rewards, values, response_lengths, gamma=gamma, lambd=lambd)[0]
    shaped_kl = torch.zeros(total, device=rewards.device) if kl is None or kl_coef == 0 else kl.float()
    if estimator == "reinforce_plus_plus_baseline":
        return per_token_reward - kl_coef * shaped_kl
    if estimator != "reinforce_plus_plus":
        raise ValueError(f"advantage_estimator={estimator!r} is not supported")
    out = []
    mask = loss_mask.float()
    for i, (kl_i, m_i) in enumerate(
        zip(shaped_kl.split(list(response_lengths)), mask.split(list(response_lengths)), strict=True)
    ):
        token_rewards = -kl_coef * kl_i * m_i
        trainable = torch.nonzero(m_i, as_tuple=True)[0]
        # A sample with no trainable token (a DP filler copy) has nothing to credit: zero advantages.
        if trainable.numel():
            token_rewards[trainable[-1]] += rewards[i].float()
        out.append(discounted_returns(token_rewards, gamma))
    return torch.cat(out)


def whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with mean and unbiased var over masked tokens of every rank.

    `all_reduce` sums a tensor over the data-parallel group (None on one rank). Every rank must call
    it, even one with no tokens.
    """
    import torch

    m = mask.to(torch.float64)
    v = values.to(torch.float64)
    stats = torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])
    if all_reduce is not None:
        stats = all_reduce(stats)
    total_sum, total_sq, count = (float(x) for x in stats)
    if count == 0:
        raise ValueError("no trainable token on any rank: cannot whiten advantages")
    mean = total_sum / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var *= count / (count - 1)
    return ((v - mean) / np.sqrt(max(var, 0.0) + eps)).to(values.dtype)


def compute_advantages(
    cfg: AlgorithmConfig,
    *,
    rewards: torch.Tensor,
    response_lengths: Sequence[int],
    loss_mask: torch.Tensor,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    before_whitening: Callable[[torch.Tensor], torch.Tensor] | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """The trainer's whole advantage computation for its shard (flat per response token).

    KL reward shaping uses `cfg.kl_loss_type`'s estimator between the old policy and the reference,
    as slime does; it needs both log-probs when `cfg.kl_coef` is non-zero.
    """
    from tether.train.algorithms.losses import approx_kl

    kl = None
    if cfg.kl_coef != 0:
        if log_probs is None or ref_log_probs is None:
            raise ValueError("--kl-coef needs the policy's and the reference model's log-probs")
        kl = approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type)
    adv = token_advantages(
        cfg.advantage_estimator,
        rewards=rewards,
        response_lengths=response_lengths,
        loss_mask=loss_mask,
        kl_coef=cfg.kl_coef,
        gamma=cfg.gamma,
        kl=kl,
        values=values,
        lambd=cfg.lambd,
    )
    if before_whitening is not None:  # on-policy distillation's penalty, as slime orders it
        adv = before_whitening(adv)
    if cfg.normalize_advantages:
        adv = whiten(adv, loss_mask, all_reduce)
    return adv.float()

"""RL and SFT losses over flat per-response-token tensors, with the step-level reduction.

Every per-token tensor here is 1-D over the response tokens of a micro-batch, concatenated in sample
order (the layout of `tether.train.batching.MicroBatchTensors`). Reduction: each token carries a
`token_weight` computed for the whole step before it started (`batching.step_loss_weights`; zero where
the loss mask is zero), and a micro-batch's loss is the *sum* of token_loss x token_weight. Summed over
micro-batches and data-parallel ranks, that is exactly the step mean (per token, or per rollout),
however the samples were split. Metrics are reduced the same way, so summing them over micro-batches
and DP ranks gives step means too.

Semantics follow slime's `policy_loss_function` (PPO clip, dual clip, GSPO sequence ratio, KL
estimators, TIS, entropy bonus).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tether.train.config import AlgorithmConfig, KlType


def approx_kl(
    log_probs: torch.Tensor,
    base_log_probs: torch.Tensor,
    kl_type: KlType,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || base) estimate from sampled tokens (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = low_var_kl = exp(-log r) - 1 + log r, with
    log r = log_probs - base_log_probs. low_var_kl is k3 clamped to [-10, 10] (slime's choice).
    `importance_ratio` (pi/pi_old) weights the estimate for an unbiased off-policy KL.
    """
    log_ratio = log_probs.float() - base_log_probs.float()
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"kl_loss_type={kl_type!r} is not one of k1, k2, k3, low_var_kl")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    return kl


def sequence_mean_log_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
) -> torch.Tensor:
    """GSPO: per token, its sequence's masked mean of (old - new) log-prob, i.e. -log of the sequence
    ratio (pi/pi_old)^(1/|y|). Gradients flow to every token of the sequence through the mean."""
    diff = (old_log_probs - log_probs) * loss_mask
    lengths = torch.as_tensor(list(response_lengths), device=log_probs.device)
    seq = torch.repeat_interleave(torch.arange(len(response_lengths), device=log_probs.device), lengths)
    sums = torch.zeros(len(response_lengths), dtype=diff.dtype, device=diff.device).index_add(0, seq, diff)
    counts = torch.zeros(len(response_lengths), dtype=diff.dtype, device=diff.device).index_add(
        0, seq, loss_mask
    )
    return (sums / counts.clamp_min(1.0))[seq]


def ppo_clip_loss(
    neg_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped policy-gradient loss and clip indicator.

    `neg_log_ratio` = old - new log-prob (per token, or GSPO's sequence value). ratio = exp(-that);
    loss = max(-r A, -clip(r, 1 - eps, 1 + eps_high) A); with dual clip (eps_clip_c > 1), tokens with
    A < 0 take min(loss, -eps_clip_c A). The indicator is 1 where the clipped term was chosen.
    """
    ratio = torch.exp(-neg_log_ratio)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c={eps_clip_c} must be > 1 (dual-clip lower bound)")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipped


@dataclass(frozen=True)
class TisResult:
    weights: torch.Tensor  # clamped importance weights (no gradient)
    ratio: torch.Tensor  # exp(train_old - rollout), unclamped
    clipped: torch.Tensor  # 1 where the clamp changed the ratio
    abs_deviation: torch.Tensor  # |ratio - 1|


def tis_weights(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float, tis_clip_low: float
) -> TisResult:
    """Truncated importance sampling between the trainer's old policy and the engine that sampled.

    ratio = exp(train_old_log_prob - rollout_log_prob), clamped to [tis_clip_low, tis_clip]."""
    ratio = torch.exp(train_log_probs.detach().float() - rollout_log_probs.float())
    weights = ratio.clamp(tis_clip_low, tis_clip)
    return TisResult(
        weights=weights,
        ratio=ratio,
        clipped=(weights != ratio).float(),
        abs_deviation=(ratio - 1.0).abs(),
    )


def weighted_sum(values: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step mean of `values` (token_weight is 0 where masked)."""
    return (values.float() * token_weight).sum()


@dataclass
class LossOutput:
    """The micro-batch loss (a share of the step mean) and its metrics (shares of step means too)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def policy_loss(
    cfg: AlgorithmConfig,
    *,
    log_probs: torch.Tensor,
    token_weight: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """slime's policy loss for one micro-batch: PPO/GSPO clip, optional TIS, entropy bonus, KL loss.

    `old_log_probs` is the trainer's log-prob before the step; when absent (one update per rollout,
    no recompute) the current log-probs, detached, stand in (ratio 1). With --use-rollout-logprobs the
    engine's log-probs are the old policy.
    """
    if cfg.use_rollout_logprobs:
        if rollout_log_probs is None:
            raise ValueError("--use-rollout-logprobs needs rollout_log_probs in the batch")
        old = rollout_log_probs
    else:
        old = old_log_probs if old_log_probs is not None else log_probs.detach()
    if cfg.advantage_estimator == "gspo":
        neg_log_ratio = sequence_mean_log_ratio(log_probs, old, loss_mask, response_lengths)
    else:
        neg_log_ratio = old - log_probs
    pg, clipped = ppo_clip_loss(neg_log_ratio, advantages, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.use_tis:
        if rollout_log_probs is None:
            raise ValueError("--use-tis needs rollout_log_probs in the batch")
        train_old = old_log_probs if old_log_probs is not None else log_probs.detach()
        tis = tis_weights(train_old, rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low)
        pg = pg * tis.weights
        metrics["tis"] = weighted_sum(tis.ratio, token_weight).detach()
        metrics["tis_clipfrac"] = weighted_sum(tis.clipped, token_weight).detach()
        metrics["tis_abs"] = weighted_sum(tis.abs_deviation, token_weight).detach()
    pg_loss = weighted_sum(pg, token_weight)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = weighted_sum(clipped, token_weight).detach()
    metrics["ppo_kl"] = weighted_sum(neg_log_ratio, token_weight).detach()
    if entropy is not None:
        entropy_mean = weighted_sum(entropy, token_weight)
        metrics["entropy"] = entropy_mean.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_mean
    if cfg.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss needs ref_log_probs in the batch")
        ratio = torch.exp(log_probs - old).detach() if cfg.use_unbiased_kl else None
        kl_loss = weighted_sum(approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type, ratio), token_weight)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss
    if ref_log_probs is not None:
        metrics["kl"] = weighted_sum(
            approx_kl(log_probs.detach(), ref_log_probs, cfg.kl_loss_type), token_weight
        )
    if rollout_log_probs is not None:
        # With --use-rollout-logprobs the old policy *is* the engine's; compare the trainer's current one.
        train_side = log_probs.detach() if cfg.use_rollout_logprobs else old.detach()
        metrics.update(mismatch_metrics(train_side, rollout_log_probs, token_weight))
    metrics["loss"] = loss.detach()
    return LossOutput(loss=loss, metrics=metrics)


def sft_loss(*, log_probs: torch.Tensor, token_weight: torch.Tensor) -> LossOutput:
    """Negative log-likelihood of the response tokens (the supervised warm-up)."""
    loss = -weighted_sum(log_probs, token_weight)
    return LossOutput(loss=loss, metrics={"loss": loss.detach(), "sft_nll": loss.detach()})


def mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, token_weight: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the engine's, on the same tokens: the mean absolute
    difference, and the mean ratio exp(train - rollout) (1 when they agree)."""
    diff = train_log_probs.float() - rollout_log_probs.float()
    return {
        "train_rollout_logprob_abs_diff": weighted_sum(diff.abs(), token_weight).detach(),
        "train_rollout_ratio": weighted_sum(torch.exp(diff), token_weight).detach(),
    }


def megatron_loss_scale(num_microbatches: int, data_parallel_size: int) -> float:
    """Factor to multiply a micro-batch loss by before handing it to Megatron's schedule.

    Megatron divides a loss returned as `(loss, metrics)` by the number of micro-batches (and multiplies
    by the CP size, which its DDP's 1/(DP x CP) gradient average cancels), and DDP averages gradients
    over data-parallel ranks. Our micro-batch losses are already shares of the step mean, whose sum over
    micro-batches and ranks is the step loss, so this factor undoes both.
    """
    return float(num_microbatches * data_parallel_size)


def sum_metrics(
    per_micro_batch: Sequence[dict[str, torch.Tensor]],
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Step metrics: the sum over micro-batches, then over data-parallel ranks via `all_reduce` (a SUM
    over the DP group). Every rank must call this with the same keys in the same order."""
    keys = sorted({k for m in per_micro_batch for k in m})
    for m in per_micro_batch:
        if set(m) != set(keys):
            raise ValueError(
                f"micro-batches report different metrics; one lacks {sorted(set(keys) - set(m))}"
            )
    if not keys:
        return {}
    total = torch.stack(
        [torch.stack([m[k].detach().float().reshape(()) for k in keys]) for m in per_micro_batch]
    )
    total = total.sum(dim=0)
    if all_reduce is not None:
        total = all_reduce(total)
    return {k: float(v) for k, v in zip(keys, total.tolist(), strict=True)}

"""RL and SFT losses over flat per-response-token tensors, with the step-level reduction.

Every per-token tensor here is 1-D over the response tokens of a micro-batch, concatenated in sample
order (the layout of `tether.train.rank.batching.MicroBatchTensors`). Reduction: each token carries a
`token_weight` computed for the whole step before it started (`batching.step_loss_weights`; zero where
the loss mask is zero), and a micro-batch's loss is the *sum* of token_loss x token_weight. Summed over
micro-batches and data-parallel ranks, that is exactly the step mean (per token, or per rollout),
however the samples were split. Metrics are reduced the same way, so summing them over micro-batches
and DP ranks gives step means too.

Semantics follow slime's `policy_loss_function` (PPO clip, dual clip, GSPO sequence ratio, CISPO, KL
estimators, TIS and custom TIS/MIS functions, custom pg-loss reducers, entropy bonus).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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


def cispo_loss(
    neg_log_ratio: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): per-token loss -sg(clip(r, 1 - eps, 1 + eps_high)) * A * log_prob, and the
    clip indicator (1 where the clamp changed the ratio).

    The ratio r = exp(-neg_log_ratio) is clamped under stop-gradient, so the gradient flows through
    the log-prob of every token, clipped or not (unlike PPO's clip, which zeroes it). The bounds are
    PPO's --eps-clip/--eps-clip-high; --eps-clip >= 1 drops the lower bound (canonical CISPO).
    """
    ratio = torch.exp(-neg_log_ratio)
    truncated = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -truncated.detach() * advantages * log_probs
    return loss, (truncated != ratio).float()


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


class LossHookError(ValueError):
    """A loss hook's output does not fit the micro-batch; names the flag and the hook's path."""

    def __init__(self, flag: str, path: str, reason: str) -> None:
        super().__init__(f"{flag} {path}: {reason}")


@dataclass(frozen=True)
class LossHooks:
    """slime's loss-side hooks for `policy_loss`, as `tether.train.algorithms.loss_hooks` loads them.

    `tis`: --custom-tis-function-path, called as slime calls it (keyword arguments, per-sample lists).
    `pg_reducer`: --custom-pg-loss-reducer-function-path, `fn(total_lengths, response_lengths,
    loss_masks, calculate_per_token_loss) -> reducer`. `args`: what the hooks get as `args`.
    `step_num_samples`: the samples of the whole optimizer step, slime's divisor of a reduced loss
    (its step_global_batch_size) when the loss is not per token.
    """

    args: Any = None
    tis: Callable[..., Any] | None = None
    tis_path: str = ""
    pg_reducer: Callable[..., Any] | None = None
    pg_reducer_path: str = ""
    calculate_per_token_loss: bool = False
    step_num_samples: int = 1


TIS_FLAG = "--custom-tis-function-path"
REDUCER_FLAG = "--custom-pg-loss-reducer-function-path"


def _flat_per_token(value: Any, n_tokens: int, flag: str, path: str, what: str) -> torch.Tensor:
    """A hook's per-token output (one flat tensor, or a list of per-sample tensors) as one flat tensor."""
    if isinstance(value, list | tuple):
        value = torch.cat([torch.as_tensor(v).reshape(-1) for v in value]) if value else torch.zeros(0)
    if not isinstance(value, torch.Tensor) or value.reshape(-1).shape[0] != n_tokens:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise LossHookError(
            flag, path, f"{what} must hold one value per response token ({n_tokens}); got {got}"
        )
    return value.reshape(-1)


@dataclass(frozen=True)
class _TisOutcome:
    pg: torch.Tensor
    masks: list[torch.Tensor]  # per sample: where the pg loss (and the other terms) still count
    metrics: dict[str, torch.Tensor]  # per token, reduced over the original loss mask


def _importance_sampling(
    cfg: AlgorithmConfig,
    hooks: LossHooks | None,
    *,
    pg: torch.Tensor,
    train_old: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    total_lengths: Sequence[int] | None,
) -> _TisOutcome:
    """slime's TIS step: --custom-tis-function-path when given, else the built-in truncation."""
    lengths = [int(n) for n in response_lengths]
    masks = list(torch.split(loss_mask, lengths))
    if hooks is None or hooks.tis is None:
        tis = tis_weights(train_old, rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low)
        return _TisOutcome(
            pg=pg * tis.weights,
            masks=masks,
            metrics={"tis": tis.ratio, "tis_clipfrac": tis.clipped, "tis_abs": tis.abs_deviation},
        )
    if total_lengths is None:
        raise ValueError(f"{TIS_FLAG} needs the micro-batch's total_lengths")
    n, path = pg.shape[0], hooks.tis_path
    out = hooks.tis(
        args=hooks.args,
        pg_loss=pg,
        train_log_probs=list(torch.split(train_old.detach(), lengths)),
        rollout_log_probs=list(torch.split(rollout_log_probs, lengths)),
        loss_masks=masks,
        total_lengths=[int(t) for t in total_lengths],
        response_lengths=lengths,
    )
    if not isinstance(out, tuple | list) or len(out) != 3:
        raise LossHookError(
            TIS_FLAG,
            path,
            f"returned {type(out).__name__}; expected (pg_loss, modified_response_masks, metrics)",
        )
    new_pg, new_masks, metrics = out
    new_pg = _flat_per_token(new_pg, n, TIS_FLAG, path, "pg_loss")
    if not isinstance(new_masks, list | tuple) or len(new_masks) != len(lengths):
        raise LossHookError(TIS_FLAG, path, f"modified_response_masks must be a list of {len(lengths)} masks")
    flat_masks = _flat_per_token(list(new_masks), n, TIS_FLAG, path, "modified_response_masks")
    if not isinstance(metrics, dict):
        raise LossHookError(TIS_FLAG, path, f"metrics must be a dict, not {type(metrics).__name__}")
    flat_metrics = {
        str(k): _flat_per_token(v, n, TIS_FLAG, path, f"metric {k!r}").detach().float()
        for k, v in metrics.items()
    }
    masks_out = list(torch.split(flat_masks.to(loss_mask.dtype), lengths))
    return _TisOutcome(pg=new_pg, masks=masks_out, metrics=flat_metrics)


def _reduce_pg(
    hooks: LossHooks,
    pg: torch.Tensor,
    masks: list[torch.Tensor],
    response_lengths: Sequence[int],
    total_lengths: Sequence[int] | None,
) -> torch.Tensor:
    """--custom-pg-loss-reducer-function-path, scaled as slime scales a reduced loss: divided by the
    step's sample count (per-sample means), or as it is with --calculate-per-token-loss (Megatron
    divides by the step's token count)."""
    assert hooks.pg_reducer is not None
    if total_lengths is None:
        raise ValueError(f"{REDUCER_FLAG} needs the micro-batch's total_lengths")
    reducer = hooks.pg_reducer(
        [int(t) for t in total_lengths],
        [int(n) for n in response_lengths],
        masks,
        hooks.calculate_per_token_loss,
    )
    if not callable(reducer):
        raise LossHookError(
            REDUCER_FLAG, hooks.pg_reducer_path, f"returned {type(reducer).__name__}, not a reducer"
        )
    value = reducer(pg)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise LossHookError(
            REDUCER_FLAG, hooks.pg_reducer_path, f"the reducer returned {value!r}; expected a scalar tensor"
        )
    value = value.reshape(())
    return value if hooks.calculate_per_token_loss else value / max(hooks.step_num_samples, 1)


def off_policy_sequence_mask(
    delta: float,
    pg: torch.Tensor,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    token_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's OPSM: a token's pg loss is dropped where its advantage is negative and its sequence's
    masked mean of (old - new) log-prob exceeds `delta` (the policy moved away from what sampled it).
    Returns the masked pg and the share of the step's loss weight masked."""
    seq_kl = sequence_mean_log_ratio(log_probs.detach(), old_log_probs.detach(), loss_mask, response_lengths)
    masked = ((advantages < 0) & (seq_kl > delta)).to(pg.dtype)
    return pg * (1.0 - masked), weighted_sum(masked, token_weight).detach()


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
    hooks: LossHooks | None = None,
    total_lengths: Sequence[int] | None = None,
) -> LossOutput:
    """slime's policy loss for one micro-batch: PPO/GSPO clip or CISPO, optional TIS (or a custom
    TIS/MIS function), entropy bonus, KL loss.

    `old_log_probs` is the trainer's log-prob before the step; when absent (one update per rollout,
    no recompute) the current log-probs, detached, stand in (ratio 1). With --use-rollout-logprobs the
    engine's log-probs are the old policy. With --use-tis or --get-mismatch-metrics, the TIS function
    may reject tokens (its modified masks): as in slime, the pg loss and every other term then count
    only the tokens kept, while the mismatch metrics (ois and the function's) count the original ones.
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
    if cfg.advantage_estimator == "cispo":
        pg, clipped = cispo_loss(neg_log_ratio, log_probs, advantages, cfg.eps_clip, cfg.clip_high)
    else:
        pg, clipped = ppo_clip_loss(neg_log_ratio, advantages, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.use_opsm:
        pg, metrics["opsm_clipfrac"] = off_policy_sequence_mask(
            cfg.opsm_threshold, pg, log_probs, old, advantages, loss_mask, response_lengths, token_weight
        )
    masks = list(torch.split(loss_mask, [int(n) for n in response_lengths]))
    kept_weight = token_weight  # the step weights of the tokens the loss terms still count
    if cfg.use_tis or cfg.get_mismatch_metrics:
        if rollout_log_probs is None:
            raise ValueError("--use-tis / --get-mismatch-metrics need rollout_log_probs in the batch")
        train_old = old_log_probs if old_log_probs is not None else log_probs.detach()
        tis = _importance_sampling(
            cfg,
            hooks,
            pg=pg,
            train_old=train_old,
            rollout_log_probs=rollout_log_probs,
            loss_mask=loss_mask,
            response_lengths=response_lengths,
            total_lengths=total_lengths,
        )
        pg, masks = tis.pg, tis.masks
        kept_weight = token_weight * torch.cat(masks).to(token_weight.dtype) if masks else token_weight
        metrics["ois"] = weighted_sum(torch.exp(-neg_log_ratio.detach()), token_weight).detach()
        for key, value in tis.metrics.items():
            metrics[key] = weighted_sum(value, token_weight).detach()
    if hooks is not None and hooks.pg_reducer is not None:
        pg_loss = _reduce_pg(hooks, pg, masks, response_lengths, total_lengths)
    else:
        pg_loss = weighted_sum(pg, kept_weight)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = weighted_sum(clipped, kept_weight).detach()
    metrics["ppo_kl"] = weighted_sum(neg_log_ratio, kept_weight).detach()
    if entropy is not None:
        entropy_mean = weighted_sum(entropy, kept_weight)
        metrics["entropy"] = entropy_mean.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_mean
    if cfg.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss needs ref_log_probs in the batch")
        ratio = torch.exp(log_probs - old).detach() if cfg.use_unbiased_kl else None
        kl_loss = weighted_sum(approx_kl(log_probs, ref_log_probs, cfg.kl_loss_type, ratio), kept_weight)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss
    if ref_log_probs is not None:
        metrics["kl"] = weighted_sum(
            approx_kl(log_probs.detach(), ref_log_probs, cfg.kl_loss_type), kept_weight
        )
    if rollout_log_probs is not None:
        # With --use-rollout-logprobs the old policy *is* the engine's; compare the trainer's current one.
        train_side = log_probs.detach() if cfg.use_rollout_logprobs else old.detach()
        metrics.update(mismatch_metrics(train_side, rollout_log_probs, kept_weight))
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

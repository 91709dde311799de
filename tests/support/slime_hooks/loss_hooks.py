"""Loss-side hooks in slime's style (--custom-tis-function-path, --custom-pg-loss-reducer-function-path),
with slime's signatures, for the trainer's loss tests.

`reject_tis`: per token, the weight exp(train - rollout) truncated at `args.cap` and a rejection mask
that drops tokens whose ratio is below `args.floor` (both keys of --custom-config-path's YAML), and a
per-token metric `ratio`; it goes through slime's CP helpers as slime's mis.py does.
`metrics_only_tis`: the mismatch metrics only (--get-mismatch-metrics without --use-tis).
`masked_sum_reducer`: the reducer that sums pg over the kept tokens (x10 under per-token loss, so
a test sees which branch ran).
"""

from typing import Any

import torch


def reject_tis(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    weights, masks, ratios = [], [], []
    for train, rollout, mask, total, length in zip(
        train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, strict=True
    ):
        ratio = torch.exp(
            all_gather_with_cp(train, total, length) - all_gather_with_cp(rollout, total, length)
        )
        weights.append(slice_log_prob_with_cp(ratio.clamp(max=args.cap), total, length))
        masks.append(mask * (ratio >= args.floor).float())
        ratios.append(ratio)
    metrics = {"ratio": torch.cat(ratios)}
    return pg_loss * torch.cat(weights), masks, metrics


def metrics_only_tis(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    diff = [(t - r).abs() for t, r in zip(train_log_probs, rollout_log_probs, strict=True)]
    return pg_loss, loss_masks, {"abs_log_diff": diff}


def wrong_shape_tis(args, *, pg_loss, loss_masks, **kwargs):
    return pg_loss[:1], loss_masks, {}


def masked_sum_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    mask = torch.cat(loss_masks)
    factor = 10.0 if calculate_per_token_loss else 1.0

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return factor * (x * mask).sum()

    return reduce


def tis_without_keywords(args, pg_loss):
    return pg_loss, [], {}

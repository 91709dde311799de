"""Advantages whitened across a step's data-parallel shards, as slime whitens them.

slime's `compute_advantages_and_returns` runs on each DP rank over its own samples and, with
--normalize-advantages, whitens them with `distributed_masked_whiten`: the masked sum, sum of
squares and token count are all-reduced over the data-parallel group, so every rank subtracts
the same mean and divides by the same deviation. tether computes advantages on the head; when
they need the trainer's log-probs (KL reward shaping, on-policy distillation) it computes them
shard by shard, and this module gives each shard's whitening the group's sums, as that
all-reduce would. Filler copies (loss mask all 0) add nothing to the sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

# torch loads where a shard whitens: the head's step work imports this without it.
AllReduce = Callable[["torch.Tensor"], "torch.Tensor"]
"""What `tether.train.algorithms.advantages.whiten` calls with a rank's masked sums: the group's total back."""

R = TypeVar("R")


def whiten_across_shards(computations: Sequence[Callable[[AllReduce | None], R]]) -> list[R]:
    """Each shard's advantages (`computations[dp_rank](all_reduce)`), whitened over every shard.

    A computation whitens (or not, without --normalize-advantages) through the `all_reduce` it is
    given. The first pass records each shard's local sums; when any shard whitened, the second
    pass gives each the sums' total (the DP group's all-reduce); otherwise the first pass's
    results stand. One shard needs no group: it runs once, with None."""
    if len(computations) == 1:
        return [computations[0](None)]
    local: list[torch.Tensor] = []

    def record(stats: torch.Tensor) -> torch.Tensor:
        import torch

        local.append(stats.detach().clone())
        # This pass's result is dropped: sums of mean 0, variance 1 whiten without failing on a
        # shard with no trainable token (the group as a whole may have some).
        return torch.tensor([0.0, 1.0, 1.0], dtype=stats.dtype)

    first = [compute(record) for compute in computations]
    if not local:
        return first  # nothing was whitened
    if len(local) != len(computations):
        raise RuntimeError(f"{len(local)} of {len(computations)} shards reached the whitening all-reduce")
    import torch

    total = torch.stack(local).sum(dim=0)
    return [compute(lambda _stats: total.clone()) for compute in computations]


__all__ = ["AllReduce", "whiten_across_shards"]

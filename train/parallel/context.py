"""Context parallelism (--context-parallel-size): each rank of a CP group runs the model on a share of
every micro-batch's sequence.

Layout (Megatron's, load-balanced for causal attention): the padded sequence of length s is cut into
2 x CP chunks and CP rank r holds chunks r and 2 x CP - 1 - r, in that order. Megatron's rotary
embedding slices itself the same way (`get_pos_emb_on_this_cp_rank`), so the ranks here only slice
the inputs (`localize`). With --allgather-cp (slime's layout for the sparse-attention models, whose
attention takes its RoPE angles by these positions: `tether.train.model.families.dsa`) rank r holds
the r-th of CP contiguous shares instead.

Attention: TransformerEngine's attention runs CP itself (the TE spec). The local spec gets
`context_parallel_attention(...)`: Megatron's local attention whose keys and values are gathered from
the CP group first (their gradients summed back to their owners), with the causal mask of this
rank's query positions against every key position.

Loss: each response token's log-prob (entropy, value) is computed on the CP rank that holds the
position predicting it, then `full_response` puts every rank's values together so the loss — and
every sequence-level term of it — sees the whole micro-batch on every CP rank. Its backward hands
each rank the gradient of its own tokens only, so the gradients summed over the CP group (Megatron's
DDP reduces over DP x CP, with the CP factor its schedule applies) are exactly the loss's gradient.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPLayout:
    """This rank's place in its context-parallel group."""

    size: int
    rank: int
    group: Any  # dist.ProcessGroup; None when size is 1
    contiguous: bool = False  # --allgather-cp: one contiguous share per rank

    def positions(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 [seq_len / size]: the global positions this rank holds, in its local order."""
        if self.size == 1:
            return torch.arange(seq_len, device=device)
        return positions(seq_len, self.size, self.rank, device, contiguous=self.contiguous)


# The layout kind of this process's CP groups, set with them (topology.init_distributed), as
# Megatron's own parallel state is.
_CONTIGUOUS = [False]


def set_contiguous(on: bool) -> None:
    """--allgather-cp: this process's CP ranks hold contiguous shares (`current` reports it)."""
    _CONTIGUOUS[0] = bool(on)


def positions(
    seq_len: int, size: int, rank: int, device: torch.device | str = "cpu", *, contiguous: bool = False
) -> torch.Tensor:
    """Chunks `rank` and `2 * size - 1 - rank` of `seq_len` positions cut into `2 * size` chunks
    (`contiguous`: the `rank`-th of `size` shares)."""
    if contiguous:
        if seq_len % size:
            raise ValueError(
                f"a sequence of {seq_len} positions does not split into {size} contiguous shares"
            )
        share = seq_len // size
        return torch.arange(rank * share, (rank + 1) * share, device=device)
    if seq_len % (2 * size):
        raise ValueError(
            f"a sequence of {seq_len} positions does not split into 2 x {size} context-parallel chunks"
        )
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


def current() -> CPLayout:
    """The layout of Megatron's parallel state (size 1 before it is initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return CPLayout(1, 0, None)
    return CPLayout(
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
        ps.get_context_parallel_group(),
        contiguous=_CONTIGUOUS[0],
    )


@functools.lru_cache(maxsize=64)
def _global_order(local: int, size: int, contiguous: bool = False) -> torch.Tensor:
    """Where each global position sits among the CP ranks' shares laid end to end (rank order):
    the index that puts an all-gather back in position order. Cached: every layer asks per pass."""
    order = torch.cat([positions(local * size, size, r, contiguous=contiguous) for r in range(size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim `dim` into global position order; backward: the gradients every rank
    computed for this rank's positions, summed (all-reduce, which gloo has; then this rank's rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, layout: CPLayout) -> torch.Tensor:
        ctx.dim, ctx.layout = dim, layout
        parts = [torch.empty_like(x) for _ in range(layout.size)]
        dist.all_gather(parts, x.contiguous(), group=layout.group)
        inverse = _global_order(int(x.shape[dim]), layout.size, layout.contiguous)
        return torch.cat(parts, dim=dim).index_select(dim, inverse.to(x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout: CPLayout = ctx.layout
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=layout.group)
        mine = layout.positions(grad.shape[ctx.dim], grad.device)
        return grad.index_select(ctx.dim, mine), None, None


def gather_sequence(x: torch.Tensor, dim: int, layout: CPLayout | None = None) -> torch.Tensor:
    """Every CP rank's share of `x` along `dim`, in global position order (differentiable)."""
    layout = layout or current()
    if layout.size == 1:
        return x
    out: torch.Tensor = _GatherSequence.apply(x, dim, layout)  # type: ignore[no-untyped-call]
    return out


class _FullResponse(torch.autograd.Function):
    """[M] values of this rank's response tokens -> [N] of the micro-batch, summed over the group
    (each token is on one rank); backward: this rank's tokens' gradient, no communication."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, which: torch.Tensor, n: int, layout: CPLayout) -> torch.Tensor:
        ctx.save_for_backward(which)
        out = local.new_zeros(n)
        out[which] = local
        dist.all_reduce(out, group=layout.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (which,) = ctx.saved_tensors
        return grad[which], None, None, None


def full_response(local: torch.Tensor, mb: Any) -> torch.Tensor:
    """The micro-batch's per-response-token values from this rank's (`mb` from `localize`); as is
    without context parallelism."""
    which = getattr(mb, "cp_which", None)
    if which is None:
        return local
    out: torch.Tensor = _FullResponse.apply(  # type: ignore[no-untyped-call]
        local, which.to(local.device), int(mb.loss_mask.numel()), current()
    )
    return out


def slice_sequence(t: torch.Tensor, layout: CPLayout | None = None) -> torch.Tensor:
    """This CP rank's positions of a [b, s, ...] tensor."""
    layout = layout or current()
    if layout.size == 1:
        return t
    return t.index_select(1, layout.positions(t.shape[1], t.device))


def local_causal_mask(
    pos: torch.Tensor, seq_len: int, key_padding: torch.Tensor | None = None
) -> torch.Tensor:
    """bool [b or 1, 1, len(pos), seq_len], True where the query at `pos` may NOT attend (Megatron)."""
    keys = torch.arange(seq_len, device=pos.device)
    mask = (keys[None, :] > pos[:, None])[None, None]
    if key_padding is not None:  # [b, s] True at padding keys
        mask = mask | key_padding[:, None, None, :]
    return mask


def localize(mb: Any, layout: CPLayout | None = None) -> Any:
    """This CP rank's share of a micro-batch (a `MicroBatchTensors` or a bare `step.MicroBatch`):
    its positions of the tokens, position ids, attention mask rows and routed experts; the response
    rows it predicts (`response_index` into its [b, s / CP] logits, `targets`), and `cp_which`, their
    places among the micro-batch's response tokens. Per-response-token columns stay whole."""
    layout = layout or current()
    if layout.size == 1:
        return mb
    s = int(mb.tokens.shape[1])
    pos = layout.positions(s)
    changes: dict[str, Any] = {
        "tokens": mb.tokens.index_select(1, pos),
        "position_ids": mb.position_ids.index_select(1, pos),
    }
    mask = getattr(mb, "attention_mask", None)
    changes["attention_mask"] = (
        local_causal_mask(pos, s) if mask is None else mask.index_select(2, pos.to(mask.device))
    )
    if hasattr(mb, "response_index"):
        local_of = torch.full((s,), -1, dtype=torch.int64)
        local_of[pos] = torch.arange(pos.numel())
        index = mb.response_index.to(torch.int64)
        row, col = index // s, index % s
        local_col = local_of[col]
        keep = local_col >= 0
        which = torch.nonzero(keep).flatten()
        changes.update(
            response_index=row[keep] * pos.numel() + local_col[keep],
            targets=mb.targets[which],
            cp_which=which,
        )
        if mb.routed_experts is not None:
            changes["routed_experts"] = mb.routed_experts.index_select(0, pos)
    return dataclasses.replace(mb, **changes)


@functools.cache
def context_parallel_attention(base: Any) -> type:
    """`base` (Megatron's local DotProductAttention or a subclass) under context parallelism: keys
    and values gathered from the CP group, queries this rank's own. Built once per base class."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if config.window_size is not None:
            raise ValueError("sliding-window attention with context parallelism needs TransformerEngine")
        # Megatron's local attention refuses CP only because it cannot gather the keys itself.
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        base.__init__(self, plain, *args, **kwargs)
        self.config = config

    def forward(
        self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        layout = current()
        return base.forward(
            self, query, gather_sequence(key, 0, layout), gather_sequence(value, 0, layout), *args, **kwargs
        )

    return type(f"ContextParallel{base.__name__}", (base,), {"__init__": __init__, "forward": forward})

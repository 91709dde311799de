"""Copies of a model's weights by name, as slime's TensorBackuper keeps them ("actor", "ref",
"old_actor", "rollout_actor"): the parameters and the MoE routers' expert_bias buffers of every
chunk (`bridge.chunk_tensors`), which is what a forward pass reads.

The copies live in host memory (pinned when there is a GPU), as slime's do, so keeping an old
actor costs no device memory. The actor and the reference model are built by the same builder,
so their chunks hold the same names and shapes on every rank, whatever TP/PP/EP cut them: a copy
by name is a copy of this rank's shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tether.train.model.bridge import chunk_tensors


def live_tensors(chunks: Sequence[Any]) -> dict[str, torch.Tensor]:
    """This rank's weights of `chunks` by name ("<chunk>.<local name>"), the live tensors."""
    out: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(chunks):
        for name, tensor in chunk_tensors(chunk):
            out[f"{i}.{name}"] = tensor
    return out


def _copy_matching(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], what: str) -> None:
    if dst.keys() != src.keys():
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        raise ValueError(
            f"{what}: the weights differ by name (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    with torch.no_grad():
        for name, d in dst.items():
            s = src[name]
            if d.shape != s.shape:
                raise ValueError(f"{what}: {name} has shape {tuple(s.shape)}, expected {tuple(d.shape)}")
            d.copy_(s, non_blocking=False)


class WeightCopy:
    """A host copy of a model's weights; `store` refreshes it, `load_into` writes it back."""

    def __init__(self, chunks: Sequence[Any]) -> None:
        pin = torch.cuda.is_available()
        self.tensors = {
            name: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            for name, t in live_tensors(chunks).items()
        }
        self.store(chunks)

    def store(self, chunks: Sequence[Any]) -> None:
        """This copy becomes the chunks' current weights."""
        _copy_matching(self.tensors, live_tensors(chunks), "storing a weight copy")

    def store_from(self, other: WeightCopy) -> None:
        """This copy becomes `other`'s weights."""
        _copy_matching(self.tensors, other.tensors, "copying a weight copy")

    def load_into(self, chunks: Sequence[Any]) -> None:
        """The chunks' weights become this copy's."""
        _copy_matching(live_tensors(chunks), self.tensors, "loading a weight copy")


def copy_weights(src: Sequence[Any], dst: Sequence[Any]) -> None:
    """`dst`'s weights become `src`'s, tensor by tensor on the device (the models share a layout)."""
    _copy_matching(live_tensors(dst), live_tensors(src), "copying weights between models")


@contextmanager
def swapped_in(chunks: Sequence[Any], copy: WeightCopy, stash: WeightCopy) -> Iterator[None]:
    """The chunks run with `copy`'s weights inside the block; their own come back after it, exactly
    (kept in `stash` meanwhile), even when the block raises."""
    stash.store(chunks)
    copy.load_into(chunks)
    try:
        yield
    finally:
        stash.load_into(chunks)

"""Group (hf_name, tensor) pairs into buckets of at most --update-weight-buffer-size bytes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Named = tuple[str, torch.Tensor]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(tensors: Iterable[Named], max_bytes: int, *, aligned: bool = False) -> Iterator[list[Named]]:
    """Yield lists of tensors whose sizes add up to at most max_bytes (a larger tensor goes alone).

    `aligned`: every tensor also starts at a byte offset its element size divides, counted from
    the bucket's start — what a flattened bucket needs (SGLang refuses it otherwise), so a tensor
    that would land unaligned starts the next bucket.
    """
    if max_bytes < 1:
        raise ValueError(f"update_weight_buffer_size={max_bytes}: must be at least 1 byte")
    bucket: list[Named] = []
    size = 0
    for name, t in tensors:
        n = nbytes(t)
        if bucket and (size + n > max_bytes or (aligned and size % t.element_size())):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def with_last(items: Iterable[list[Named]]) -> Iterator[tuple[list[Named], bool]]:
    """Pair each bucket with whether it is the last (the one that sets the new version)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def dtype_name(t: torch.Tensor) -> str:
    """SGLang's dtype spelling: 'bfloat16', 'float32', ..."""
    return str(t.dtype).removeprefix("torch.")

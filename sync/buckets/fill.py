"""Forming a distributed sync's buckets as the export produces tensors, ready to broadcast.

`BucketFiller.next()` pulls (name, tensor) pairs from the export until the bucket is full and
returns it; the sender calls it in a worker thread while the previous bucket is on the wire, so
the export of bucket k+1 (TP gathers, conversion, device copies) overlaps the broadcast of
bucket k. For a flattened bucket each tensor is written straight from where the export left it
into the bucket's flat buffer at its offset (one copy, which also moves it to the wire device):
no per-tensor device copy first and no pack pass over the finished bucket. A bucket of one
tensor is broadcast from that tensor's own bytes, with no copy at all.

Every bucket may fill up to --update-weight-buffer-size. (Ramping sizes up from a small first
bucket, so that less export waits before the first broadcast, was measured against the CPU
engine and lost: each extra bucket costs an engine round trip of about 10 ms, more than a free
export's first bucket saves.)

Two flat buffers are used in turn: bucket k+1 fills one while bucket k's broadcast reads the
other, and the sender starts filling k+1 only after bucket k-1's broadcast completed. The
sender decides how long they live: a CPU sender keeps them across syncs (filling a fresh
256 MiB buffer took 132 ms here, a kept one 52 ms), a GPU sender frees them when each sync ends
(torch's caching allocator hands the memory out again cheaply, to training too).

Every step runs with the wire device current when it is a GPU (the export allocates on the
current device, and a worker thread's current GPU is 0 whatever the rank chose).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from tether.runtime.weight_group import gpu_current
from tether.sync.buckets.grouping import Named, nbytes


class Bucket(NamedTuple):
    """One bucket: its tensors (for names, dtypes and shapes), whether it is the sync's last, and
    for a flattened bucket its bytes in order as one uint8 tensor on the wire device."""

    number: int
    tensors: list[Named]
    last: bool
    flat: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t) for _, t in self.tensors)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _place(flat: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """Copy `t` (any device, any strides) into flat[offset:] and return it as a view there; the
    offset is one its element size divides (the bucketing sees to it)."""
    into = flat[offset : offset + nbytes(t)].view(t.dtype).view(t.shape)
    into.copy_(t.detach())
    return into


class BucketFiller:
    """Buckets of one sync's tensors, pulled from the export one bucket per `next()` call.

    `flattened`: fill flat buffers (the tensors start at offsets their element size divides,
    as SGLang requires); else each tensor is moved to the wire device and kept as it is.
    `pack` False (with `flattened`): a flattened bucket's boundaries, but its tensors kept as
    they are, for a receiver that lands them in one buffer itself (a streamed update).
    `buffers`: the two kept flat buffers, replaced in place when a bucket needs a larger one.
    Not thread-safe: one `next()` at a time (the sender awaits each before the next).
    """

    def __init__(
        self,
        tensors: Iterable[Named],
        max_bytes: int,
        device: torch.device,
        *,
        flattened: bool,
        buffers: list[torch.Tensor | None],
        pack: bool = True,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"update_weight_buffer_size={max_bytes}: must be at least 1 byte")
        if len(buffers) != 2:
            raise ValueError("a filler takes exactly two flat buffers, used in turn")
        self._source = iter(tensors)
        self._limit = max_bytes
        self._device = device
        self._flattened = flattened
        self._pack = flattened and pack
        self._buffers = buffers
        self._carry: Named | None = None
        self._index = 0
        self._done = False

    def _pull(self) -> Named | None:
        if self._carry is not None:
            got, self._carry = self._carry, None
            return got
        return next(self._source, None)

    def _buffer(self, slot: int, size: int) -> torch.Tensor:
        kept = self._buffers[slot]
        if kept is None or kept.numel() < size or kept.device != self._device:
            kept = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self._device)
        return kept

    def next(self) -> Bucket | None:
        """The next bucket (the export runs while this fills it), or None after the last."""
        with gpu_current(self._device):
            return self._next()

    def _next(self) -> Bucket | None:
        if self._done:
            return None
        limit = self._limit
        slot = self._index % 2
        bucket: list[Named] = []
        flat: torch.Tensor | None = None
        size = 0
        while True:
            got = self._pull()
            if got is None:
                self._done = True
                break
            name, t = got
            n = nbytes(t)
            if bucket and (size + n > limit or (self._flattened and size % t.element_size())):
                self._carry = got  # starts the next bucket
                break
            if not self._pack:
                bucket.append((name, t.detach().to(self._device).contiguous()))
                size += n
                continue
            if len(bucket) == 1:
                # A second tensor joins: from here on the bucket lives in a flat buffer.
                first_name, first = bucket[0]
                flat = self._buffer(slot, max(limit, size))
                bucket[0] = (first_name, _place(flat, 0, first))
            if bucket:
                assert flat is not None and size + n <= flat.numel()  # only a lone tensor exceeds it
                bucket.append((name, _place(flat, size, t)))
            else:
                bucket.append((name, t.detach()))  # alone, it is broadcast from its own bytes
            size += n
        if not bucket:
            return None
        self._index += 1
        if not self._pack:
            return Bucket(self._index - 1, bucket, self._done, None)
        if len(bucket) == 1:
            name, t = bucket[0]
            bucket[0] = (name, t.to(self._device).contiguous())
            return Bucket(self._index - 1, bucket, self._done, _bytes_view(bucket[0][1]))
        assert flat is not None
        return Bucket(self._index - 1, bucket, self._done, flat[:size])

"""Receiving one bucket of a distributed weight update into the CPU engine's model.

The trainer broadcasts a bucket either tensor by tensor (SGLang's default) or as one uint8
buffer holding every tensor's bytes in order (load_format="flattened_bucket"). Names, dtypes
and shapes arrive first over HTTP, so the bucket is checked before any byte lands: a bucket
that does not fit the model is still drained (the sender's collectives must complete and the
group stay usable) and then refused with the parameters untouched.

A tensor whose dtype and shape match its live parameter is received straight into it: the
broadcast is then the whole cost of the update, as in SGLang. The receive runs between two
scheduler steps, so no forward pass reads a parameter while it changes. A collective that
breaks mid-bucket can leave a parameter half written; the sender then reloads the engine from
its last full checkpoint (DistributedTransport.restore_from), as it must for a half-applied
sync anyway. Everything else lands in one receive buffer kept across updates (fresh pages
every sync would cost as much as the copy) and is copied into place. A flattened bucket is
one buffer that becomes the storage of its parameters (see _receive_flat).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tether.rollout.engine_model import TinyLM, WeightMismatch, check_named
from tether.runtime.weight_group import WeightGroup, broadcast

_ALIGN = 64  # every staged tensor starts on a cache line, so any dtype can view it


class BucketReceiver:
    """Owns the reusable receive buffer; one per engine (updates are serialised by its lock)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def release(self) -> None:
        """Free the receive buffer (memory released on request; the next update makes a new one)."""
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def receive(
        self,
        model: TinyLM,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        group: WeightGroup,
        flattened: bool,
    ) -> None:
        """Receive the bucket from rank 0 of `group` and load it; WeightMismatch if it does not fit."""
        refusal: WeightMismatch | None = None
        try:
            if len(set(names)) != len(names):
                raise WeightMismatch("a name appears twice in one bucket")
            if not model.loaded:
                raise WeightMismatch("the weights are released; resume memory occupation first")
            metas = {
                n: torch.empty(list(s), dtype=d, device="meta")
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            }
            check_named(model.cfg, metas, complete=False)
            if flattened:
                _check_aligned(names, dtypes, shapes)
        except WeightMismatch as e:
            refusal = e
        items = [(n, d, s, _nbytes(d, s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if flattened:
            self._receive_flat(model, items, group, refusal)
        else:
            self._receive_each(model, items, group, refusal)
        if refusal is not None:
            raise refusal

    def _receive_flat(
        self,
        model: TinyLM,
        items: list[tuple[str, torch.dtype, Sequence[int], int]],
        group: WeightGroup,
        refusal: WeightMismatch | None,
    ) -> None:
        total = sum(size for *_, size in items)
        if refusal is not None:
            broadcast(self._staging(total), 0, group)
            return
        # A bucket's bytes land in a buffer that then backs its parameters (views, no copy); the
        # next sync's identical bucket lands in the same buffer, in place. The model owns these
        # buffers, so released weights free them.
        key = tuple((name, dtype, tuple(shape)) for name, dtype, shape, _ in items)
        arena = model.arenas.get(key)
        if arena is None or not self._backs(model, arena, items):
            arena = torch.empty(total, dtype=torch.uint8)
        broadcast(arena, 0, group)
        offset = 0
        for name, dtype, shape, size in items:
            raw = arena[offset : offset + size]
            offset += size
            tensor = raw.view(dtype).view(list(shape))  # offsets were checked to be aligned
            if dtype == model.dtype:
                model.adopt(name, tensor)
            else:  # converted into a float32 parameter
                model.assign(name, tensor)
        model.arenas[key] = arena
        backing = {p.untyped_storage().data_ptr() for p in model.params.values()}
        model.arenas = {k: a for k, a in model.arenas.items() if a.data_ptr() in backing}

    @staticmethod
    def _backs(
        model: TinyLM, arena: torch.Tensor, items: list[tuple[str, torch.dtype, Sequence[int], int]]
    ) -> bool:
        """Whether every same-dtype parameter of the bucket still is its view of `arena`."""
        offset, base = 0, arena.data_ptr()
        for name, dtype, _, size in items:
            live = model.params.get(name)
            if (
                dtype == model.dtype
                and not model.ignores(name)
                and (live is None or live.data_ptr() != base + offset)
            ):
                return False
            offset += size
        return True

    def _receive_each(
        self,
        model: TinyLM,
        items: list[tuple[str, torch.dtype, Sequence[int], int]],
        group: WeightGroup,
        refusal: WeightMismatch | None,
    ) -> None:
        targets: list[tuple[str, torch.Tensor, bool]] = []  # (name, where it lands, is it staged)
        staged_bytes = 0
        plan: list[tuple[str, torch.dtype, Sequence[int], int, torch.Tensor | None]] = []
        for name, dtype, shape, size in items:
            live = None if refusal is not None else model.receive_target(name, dtype, shape)
            plan.append((name, dtype, shape, staged_bytes, live))
            if live is None:
                staged_bytes += -(-size // _ALIGN) * _ALIGN
        buf = self._staging(staged_bytes)
        for name, dtype, shape, offset, live in plan:
            if live is not None:
                targets.append((name, live, False))
            else:
                size = _nbytes(dtype, shape)
                targets.append((name, buf[offset : offset + size].view(dtype).view(list(shape)), True))
        # Post every receive at once, like the sender's sends, and load each as it completes.
        works = [dist.broadcast(t, src=0, group=group.group, async_op=True) for _, t, _ in targets]
        for work, (name, tensor, staged) in zip(works, targets, strict=True):
            assert work is not None
            work.wait()
            if staged and refusal is None:
                model.assign(name, tensor)


def _check_aligned(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> None:
    """A flattened bucket's tensors must start at offsets their element size divides (SGLang
    refuses the bucket otherwise; tether's sender splits buckets so that they do)."""
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise WeightMismatch(
                f"{name}: byte offset {offset} in the flattened bucket is not a multiple of its "
                f"{dtype} element size {dtype.itemsize}"
            )
        offset += _nbytes(dtype, shape)


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n

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

Unless the engine accepts non-finite weights (--allow-nonfinite-weights), no byte lands in a
live parameter before the whole bucket is checked for NaN and inf, so a refused bucket leaves
the served weights as they were. Without a copy: a tensor that would land in its live
parameter lands in a spare of the same shape instead, and once the bucket passes the two swap
(the old parameter becomes the spare for the next sync); a flattened bucket lands in a spare
buffer that then backs its parameters. The price is a second copy of the received weights in
memory; the straight-into-live receive is kept for engines that skip the check.

Buffers live on the group's wire device (`wire_device`): the engine's GPU for an NCCL group,
host memory for gloo; a tensor received on the host is copied onto the model's device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from tether.rollout.cpu_engine.modeling.model import TinyLM, WeightMismatch, check_finite, check_named
from tether.runtime.weight_group import WeightGroup, broadcast

_ALIGN = 64  # every staged tensor starts on a cache line, so any dtype can view it


def wire_device(group: WeightGroup, model: TinyLM) -> torch.device:
    """Where a broadcast of `group` lands: NCCL moves GPU memory only, gloo host memory."""
    return model.device if group.backend == "nccl" else torch.device("cpu")


class BucketReceiver:
    """Owns the reusable receive buffer; one per engine (updates are serialised by its lock)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        # Checked receives land here first: by parameter name, and by flattened bucket key.
        self._spares: dict[str, torch.Tensor] = {}
        self._spare_arenas: dict[Hashable, torch.Tensor] = {}

    def release(self) -> None:
        """Free the receive buffers (memory released on request; the next update makes new ones)."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._spares, self._spare_arenas = {}, {}

    def _spare(self, name: str, live: torch.Tensor) -> torch.Tensor:
        spare = self._spares.pop(name, None)
        if spare is None or spare.dtype != live.dtype or spare.shape != live.shape:
            spare = torch.empty_like(live, memory_format=torch.contiguous_format)
        return spare

    def _keep_spare(self, name: str, old: torch.Tensor) -> None:
        # A parameter that is a view of a bigger buffer (a flattened bucket's) is not reused:
        # writing into it would write into memory it shares with others.
        if old.is_contiguous() and old.untyped_storage().nbytes() == old.numel() * old.element_size():
            self._spares[name] = old

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes]

    def receive(
        self,
        model: TinyLM,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        group: WeightGroup,
        flattened: bool,
        check_values: bool = True,
        refuse: WeightMismatch | None = None,
        pieces: bool = False,
    ) -> None:
        """Receive the bucket from rank 0 of `group` and load it; WeightMismatch if it does not fit
        or (with `check_values`) holds NaN or inf, the parameters untouched in both cases.
        `refuse`: drain the bucket without loading it and raise this (a streamed update that
        already failed an earlier bucket). `pieces`: a flattened bucket's tensors arrive one by
        one (a streamed update: the sender packs nothing) and land in its one buffer all the same."""
        refusal: WeightMismatch | None = refuse
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
            refusal = refusal or e
        items = [(n, d, s, _nbytes(d, s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if flattened:
            refusal = self._receive_flat(model, items, group, refusal, check_values, pieces) or refusal
        else:
            refusal = self._receive_each(model, items, group, refusal, check_values) or refusal
        if refusal is not None:
            raise refusal

    def _receive_flat(
        self,
        model: TinyLM,
        items: list[tuple[str, torch.dtype, Sequence[int], int]],
        group: WeightGroup,
        refusal: WeightMismatch | None,
        check_values: bool,
        pieces: bool = False,
    ) -> WeightMismatch | None:
        total = sum(size for *_, size in items)
        device = wire_device(group, model)
        if refusal is not None:
            _land(self._staging(total, device), items, group, pieces)
            return None
        # A bucket's bytes land in a buffer that then backs its parameters (views, no copy); the
        # next sync's identical bucket lands in the same buffer, in place. The model owns these
        # buffers, so released weights free them.
        key = tuple((name, dtype, tuple(shape)) for name, dtype, shape, _ in items)
        arena = model.arenas.get(key)
        backs = arena is not None and self._backs(model, arena, items)
        if check_values:
            # Into the spare buffer, which nothing serves from; it backs the parameters only
            # once checked, and the buffer it replaces is the spare of the next sync.
            landing = self._spare_arenas.pop(key, None)
            if landing is None or landing.numel() != total or landing.device != device:
                landing = torch.empty(total, dtype=torch.uint8, device=device)
            bad = _land(landing, items, group, pieces, check=True)
            if bad is not None:
                self._spare_arenas[key] = landing
                return bad
            if arena is not None and backs:
                self._spare_arenas[key] = arena
            arena = landing
        else:
            if arena is None or not backs:
                arena = torch.empty(total, dtype=torch.uint8, device=device)
            _land(arena, items, group, pieces)
        offset = 0
        for name, dtype, shape, size in items:
            raw = arena[offset : offset + size]
            offset += size
            tensor = raw.view(dtype).view(list(shape))  # offsets were checked to be aligned
            if dtype == model.dtype and device == model.device:
                model.adopt(name, tensor)
            else:  # converted into the model's dtype, copied onto its device
                model.assign(name, tensor)
        model.arenas[key] = arena
        backing = {p.untyped_storage().data_ptr() for p in model.params.values()}
        model.arenas = {k: a for k, a in model.arenas.items() if a.data_ptr() in backing}
        return None

    @staticmethod
    def _backs(
        model: TinyLM, arena: torch.Tensor, items: list[tuple[str, torch.dtype, Sequence[int], int]]
    ) -> bool:
        """Whether every same-dtype parameter of the bucket still is its view of `arena`."""
        if arena.device != model.device:
            return False
        offset, base = 0, arena.data_ptr()
        for name, dtype, _, size in items:
            live = model.params.get(model.cfg.canonical(name))
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
        check_values: bool,
    ) -> WeightMismatch | None:
        # (name, where it lands, how it is loaded: "live" in place, "swap" a spare, "stage" a copy)
        targets: list[tuple[str, torch.Tensor, str]] = []
        staged_bytes = 0
        device = wire_device(group, model)
        plan: list[tuple[str, torch.dtype, Sequence[int], int, torch.Tensor | None]] = []
        for name, dtype, shape, size in items:
            live = None if refusal is not None else model.receive_target(name, dtype, shape)
            if live is not None and live.device != device:
                live = None  # a host-side group (gloo) cannot write into GPU memory
            plan.append((name, dtype, shape, staged_bytes, live))
            if live is None:
                staged_bytes += -(-size // _ALIGN) * _ALIGN
        buf = self._staging(staged_bytes, device)
        for name, dtype, shape, offset, live in plan:
            if live is not None and check_values:
                targets.append((name, self._spare(name, live), "swap"))
            elif live is not None:
                targets.append((name, live, "live"))
            else:
                size = _nbytes(dtype, shape)
                targets.append((name, buf[offset : offset + size].view(dtype).view(list(shape)), "stage"))
        # Post every receive at once, like the sender's sends, and load each as it completes
        # (checked ones once the whole bucket has arrived).
        works = [dist.broadcast(t, src=0, group=group.group, async_op=True) for _, t, _ in targets]
        poisoned: WeightMismatch | None = None
        for work, (name, tensor, how) in zip(works, targets, strict=True):
            assert work is not None
            work.wait()
            if refusal is not None:
                continue
            if not check_values:
                if how == "stage":
                    model.assign(name, tensor)
            elif poisoned is None:
                try:  # while the later tensors are still arriving
                    check_finite([(name, tensor)])
                except WeightMismatch as e:
                    poisoned = e
        if refusal is not None or not check_values:
            return None
        if poisoned is not None:
            for name, tensor, how in targets:
                if how == "swap":
                    self._spares[name] = tensor
            return poisoned
        for name, tensor, how in targets:
            if how == "swap":
                old = model.params[model.cfg.canonical(name)]
                model.adopt(name, tensor)
                self._keep_spare(name, old)
            else:
                model.assign(name, tensor)
        return None


def _land(
    buffer: torch.Tensor,
    items: list[tuple[str, torch.dtype, Sequence[int], int]],
    group: WeightGroup,
    pieces: bool,
    check: bool = False,
) -> WeightMismatch | None:
    """Receive a flattened bucket into `buffer`: as one broadcast, or (`pieces`) one per tensor
    into its byte range, every receive posted at once. `check`: the first tensor holding NaN or
    inf (with `pieces` each is checked as soon as it has arrived, while the rest arrive)."""
    views = _views(buffer, items) if check else []
    if not pieces:
        broadcast(buffer, 0, group)
        try:
            check_finite(views)
        except WeightMismatch as e:
            return e
        return None
    works = []
    offset = 0
    for *_, size in items:
        works.append(dist.broadcast(buffer[offset : offset + size], src=0, group=group.group, async_op=True))
        offset += size
    bad: WeightMismatch | None = None
    for i, work in enumerate(works):
        assert work is not None
        work.wait()
        if check and bad is None:
            try:
                check_finite([views[i]])
            except WeightMismatch as e:
                bad = e
    return bad


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


def _views(
    buffer: torch.Tensor, items: list[tuple[str, torch.dtype, Sequence[int], int]]
) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of a flattened bucket as a view of `buffer` (offsets checked to be aligned)."""
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, dtype, shape, size in items:
        out.append((name, buffer[offset : offset + size].view(dtype).view(list(shape))))
        offset += size
    return out


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return n

"""--offload-train: the trainer's device memory goes to host RAM while colocated engines generate.

slime pauses the trainer's CUDA allocations with torch_memory_saver. tether moves storages instead:
every storage behind the actor's parameters, DDP's contiguous parameter and gradient buffers (and
the `main_grad` views into them), the optimizer's main parameters and state, and the reference
model's weights is copied into pinned host memory and then shrunk to zero bytes
(`UntypedStorage.resize_(0)`, what Megatron's own buffers do in `offload_to_cpu`). Every tensor and
view keeps its storage object, so nothing that holds a view (DDP's buckets, the distributed
optimizer's shard views, `param.main_grad`) needs to be rebound: `onload` grows each storage back
and copies the bytes in. `torch.cuda.empty_cache()` then hands the freed blocks back to the driver
so the engines can allocate them.

A weight sync needs only the actor's weights on the device: `onload_weights` brings back the
storages behind the actor's parameters and buffers alone (what an export reads, a fraction of
what training holds), and `drop_weights` frees them again without a copy: an export only reads
them, so the host copy still holds their bytes.

Only CUDA storages are moved (on a CPU rank there is no device memory to free, and the flag is
refused when a run is planned on CPU). Call both on every rank, between collective calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8, pinned, the storage's bytes
    weights: bool = False  # behind the actor's parameters or buffers (what an export reads)


@dataclass
class TrainerOffload:
    """The storages of one offload; `onload` puts them back where they were."""

    moved: list[_Moved] = field(default_factory=list)
    weights_on_device: bool = False  # `onload_weights` brought the weights back, the rest is out

    @property
    def nbytes(self) -> int:
        return sum(m.host.numel() for m in self.moved)

    @property
    def offloaded(self) -> bool:
        return bool(self.moved)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


def _tensors_of_optimizer(optimizer: Any) -> Iterator[torch.Tensor]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _tensors_of_chunks(chunks: Iterable[Any]) -> Iterator[torch.Tensor]:
    for chunk in chunks:
        # Megatron's DDP keeps its contiguous buffers in a list attribute named `buffers`
        # (shadowing nn.Module.buffers); a bare GPTModel (the reference) has none.
        ddp_buffers = getattr(chunk, "buffers", None)
        if isinstance(ddp_buffers, list):
            for buffer in ddp_buffers + list(getattr(chunk, "expert_parallel_buffers", [])):
                for name in ("param_data", "grad_data"):
                    data = getattr(buffer, name, None)
                    if isinstance(data, torch.Tensor):
                        yield data
        for p in chunk.parameters():
            yield p
            main_grad = getattr(p, "main_grad", None)
            if isinstance(main_grad, torch.Tensor):
                yield main_grad
            if p.grad is not None:
                yield p.grad
        for _, b in chunk.named_buffers():
            yield b


def collect_storages(
    tensors: Iterable[torch.Tensor], device_type: str = "cuda"
) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages on `device_type` behind `tensors` (views of one storage
    count once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def offload_storages(
    storages: Iterable[torch.UntypedStorage], weights: Iterable[torch.UntypedStorage] = ()
) -> TrainerOffload:
    """Copy each storage to (pinned, with CUDA) host memory, then shrink it to zero bytes;
    those also in `weights` are the ones `onload_weights` brings back."""
    state = TrainerOffload()
    pin = torch.cuda.is_available()
    weight_ptrs = {s.data_ptr() for s in weights if s.nbytes()}
    for storage in storages:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(_as_bytes(storage), non_blocking=pin)
        state.moved.append(_Moved(storage, host, weights=storage.data_ptr() in weight_ptrs))
    _synchronize()  # every copy landed before any storage shrinks
    for moved in state.moved:
        moved.storage.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return state


def _grow(moved: Iterable[_Moved]) -> None:
    pin = torch.cuda.is_available()
    for m in moved:
        m.storage.resize_(m.host.numel())
        _as_bytes(m.storage).copy_(m.host, non_blocking=pin)
    _synchronize()


def onload_storages(state: TrainerOffload) -> None:
    """Grow every storage back to its size and copy its bytes in; `state` is empty afterwards."""
    _grow(m for m in state.moved if not (m.weights and state.weights_on_device))
    state.moved.clear()
    state.weights_on_device = False


def onload_weights(state: TrainerOffload) -> None:
    """Bring back only the weights' storages (for an export); the rest stays in host memory."""
    if not state.weights_on_device:
        _grow(m for m in state.moved if m.weights)
        state.weights_on_device = True


def drop_weights(state: TrainerOffload) -> None:
    """Free the weights `onload_weights` brought back. No copy: an export only read them, so the
    host copy still holds their bytes."""
    if not state.weights_on_device:
        return
    _synchronize()  # no kernel still reads them
    for m in state.moved:
        if m.weights:
            m.storage.resize_(0)
    state.weights_on_device = False
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trainer_tensors(actor: Any, reference: Any | None = None) -> list[torch.Tensor]:
    """Every tensor the trainer keeps between steps: the actor's parameters, DDP buffers, gradients
    and optimizer parameters and state, and the reference's weights (views included)."""
    tensors = [*_tensors_of_chunks(actor.chunks), *_tensors_of_optimizer(actor.optimizer)]
    if reference is not None:
        tensors += list(_tensors_of_chunks(reference.chunks))
    return tensors


def weight_tensors(actor: Any) -> list[torch.Tensor]:
    """The actor's parameters and buffers: what an export of its weights reads."""
    # `named_buffers`: Megatron's DDP shadows nn.Module.buffers with its list of grad buffers.
    return [
        t for chunk in actor.chunks for t in (*chunk.parameters(), *(b for _, b in chunk.named_buffers()))
    ]


def offload_trainer(actor: Any, reference: Any | None = None) -> TrainerOffload:
    """Move the actor's weights, gradients and optimizer state (and the reference's weights) to
    host RAM and free their device memory. Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("offloading the trainer needs CUDA (--offload-train is refused on CPU plans)")
    torch.cuda.synchronize()
    return offload_storages(
        collect_storages(trainer_tensors(actor, reference)), collect_storages(weight_tensors(actor))
    )


def onload_trainer(state: TrainerOffload) -> None:
    """Bring back what `offload_trainer` moved, before the next train step or forward."""
    onload_storages(state)

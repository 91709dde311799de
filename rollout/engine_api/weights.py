"""Weight payloads for /update_weights_from_tensor, in the serialised form SGLang accepts.

SGLang takes `serialized_named_tensors`: one entry per TP rank, each the base64 text of a
list of (name, tensor) pickled by multiprocessing's ForkingPickler with torch's reducers, so
that a tensor travels as a shared-memory handle rather than as bytes. On CPU the handle is a
file-system shared-memory name (torch's "file_system" sharing strategy); file descriptors
cannot cross an HTTP request.

On GPU the handle is a CUDA IPC handle whose device is named by the GPU's UUID (`_UuidPickler`);
only an engine on CUDA opens one (`decode_named_tensors(..., device=...)`), mapping the UUID to
its own index of that GPU, or refusing the payload as SGLang does when it cannot see that GPU.

Pickle runs code, so the decoder only resolves the handful of torch rebuild functions, storage
classes and dtypes such a payload needs; any other global is refused with an error naming it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import PurePosixPath
from typing import ClassVar

import torch
import torch.multiprocessing as torch_mp  # importing it registers torch's tensor reducers

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.multiprocessing.reductions": frozenset(
        {"rebuild_tensor", "rebuild_storage_filename", "rebuild_typed_storage", "rebuild_storage_empty"}
    ),
    "torch.storage": frozenset({"UntypedStorage", "TypedStorage"}),
    "torch": frozenset({"Tensor", "UntypedStorage", "TypedStorage", "Size"}),
}


class PayloadRejected(ValueError):
    """The serialised tensors are malformed or name a class outside the allowed set."""


# A file_system payload names shared memory by path: torch's own names are
# "/torch_<pid>_<random>_<n>" (in /dev/shm) and "<tmpdir>/torch-shm-dir-<random>/manager.sock".
_SHM_HANDLE = re.compile(rb"/torch_\d+_\d+_\d+")


def _is_torch_manager(manager: object) -> bool:
    if not isinstance(manager, bytes):
        return False
    path = PurePosixPath(os.fsdecode(manager))
    return (
        path.is_absolute()
        and ".." not in path.parts
        and path.name == "manager.sock"
        and path.parent.name.startswith("torch-shm-dir-")
    )


def _rebuild_storage_filename(cls: object, manager: object, handle: object, *args: object) -> object:
    """torch's rebuild_storage_filename, for names torch makes only: any other path in the
    payload (another file in /dev/shm, a socket elsewhere) is refused before it is opened."""
    from torch.multiprocessing import reductions

    if not isinstance(handle, bytes) or not _SHM_HANDLE.fullmatch(handle):
        raise PayloadRejected(f"serialized_named_tensors: shared-memory handle {handle!r} is not torch's")
    if not _is_torch_manager(manager):
        raise PayloadRejected(f"serialized_named_tensors: shared-memory manager {manager!r} is not torch's")
    return reductions.rebuild_storage_filename(cls, manager, handle, *args)


# rebuild_cuda_tensor's argument naming the storage's device: an index, or tether's GPU UUID.
_CUDA_DEVICE_ARG = 6


def _visible_index(device: object) -> int:
    """This process's index of the GPU a CUDA payload names (by UUID, or by index as torch sends
    it); PayloadRejected, in SGLang's words, for a GPU this process cannot see."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise PayloadRejected(
            f"Invalid device_uuid={device}: no GPU visible to this engine has that UUID "
            "(the sender's GPU is outside its CUDA_VISIBLE_DEVICES)"
        )
    raise PayloadRejected(f"serialized_named_tensors: CUDA device {device!r} is neither an index nor a UUID")


def _rebuild_cuda_tensor(*args: object) -> object:
    """torch's rebuild_cuda_tensor, with the device mapped to this process's index first."""
    from torch.multiprocessing import reductions

    if len(args) <= _CUDA_DEVICE_ARG:
        raise PayloadRejected("serialized_named_tensors: a CUDA tensor entry has too few fields")
    mapped = (*args[:_CUDA_DEVICE_ARG], _visible_index(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*mapped)  # type: ignore[no-untyped-call]


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, cuda: bool) -> None:
        super().__init__(file)
        self.cuda = cuda

    def find_class(self, module: str, name: str) -> object:
        if module == "torch.multiprocessing.reductions" and name == "rebuild_storage_filename":
            return _rebuild_storage_filename
        if module == "torch.multiprocessing.reductions" and name == "rebuild_cuda_tensor":
            if not self.cuda:
                raise PayloadRejected(
                    "serialized_named_tensors holds CUDA tensors; this engine runs on the CPU "
                    "(start it with --device cuda to take CUDA IPC handles)"
                )
            return _rebuild_cuda_tensor
        if name in _ALLOWED.get(module, frozenset()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PayloadRejected(f"serialized_named_tensors refers to {module}.{name}, which is not allowed")


@contextmanager
def _file_system_sharing() -> Iterator[None]:
    # torch keeps the strategy process-wide; switch it only while encoding, then restore it.
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)


def share_named_tensors(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copies of the tensors that another process can open: in fresh shared memory on CPU, a
    fresh CUDA allocation on GPU (sent as a CUDA IPC handle). Sharing a live parameter in place
    would move the trainer's own storage, and torch reuses a storage's shared-memory name, which
    the engine may already have released. Keep the copies until every engine has answered:
    freeing them unlinks the memory."""
    with torch.no_grad():
        return [
            (name, t.detach().clone(memory_format=torch.contiguous_format))
            if t.is_cuda
            else (name, t.detach().to("cpu", copy=True).contiguous().share_memory_())
            for name, t in named
        ]


class _UuidPickler(ForkingPickler):
    """torch's tensor pickling, with a CUDA tensor's device named by its UUID rather than its
    index: the trainer and an engine see one GPU under different CUDA_VISIBLE_DEVICES orders.
    SGLang's receiver accepts either form."""

    _extra_reducers: ClassVar[dict[type, Callable[..., object]]] = dict(
        ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    )


def _reduce_by_uuid(t: torch.Tensor) -> tuple[object, tuple[object, ...]]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        # rebuild_cuda_tensor's 7th argument is the storage's device index.
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


_UuidPickler._extra_reducers[torch.Tensor] = _reduce_by_uuid


def serialize_named_tensors(shared: list[tuple[str, torch.Tensor]]) -> str:
    """One engine rank's `serialized_named_tensors` entry (base64 text) for tensors from
    `share_named_tensors`. SGLang opens a CUDA payload once per rank (CUDA IPC reference counts),
    so each rank gets its own call."""
    with _file_system_sharing():
        buf = io.BytesIO()
        _UuidPickler(buf).dump(shared)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_named_tensors(
    named: list[tuple[str, torch.Tensor]], keep_alive: list[torch.Tensor] | None = None
) -> str:
    """Share and serialise in one step (one rank's entry); the copies are appended to
    `keep_alive`, which must outlive the engine's answer."""
    shared = share_named_tensors(named)
    if keep_alive is not None:
        keep_alive.extend(t for _, t in shared)
    return serialize_named_tensors(shared)


def decode_named_tensors(
    payload: str | bytes, device: torch.device | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The engine side: copy the tensors a payload refers to. Raises PayloadRejected.

    `device`: the engine's; a CUDA one also takes CUDA IPC handles, whose tensors are copied
    onto it (the sender frees its memory once the engine has answered). Without it, or on CPU,
    a payload of CUDA tensors is refused."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadRejected(f"serialized_named_tensors is not valid base64: {e}") from e
    cuda = device is not None and device.type == "cuda"
    try:
        obj = _TensorUnpickler(io.BytesIO(data), cuda).load()
    except PayloadRejected:
        raise
    except Exception as e:
        raise PayloadRejected(f"serialized_named_tensors cannot be decoded: {type(e).__name__}: {e}") from e
    if not isinstance(obj, list | tuple) or not all(
        isinstance(x, tuple | list)
        and len(x) == 2
        and isinstance(x[0], str)
        and isinstance(x[1], torch.Tensor)
        for x in obj
    ):
        raise PayloadRejected("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [
        (name, tensor.to(device or tensor.device, copy=True) if tensor.is_cuda else tensor.clone())
        for name, tensor in obj
    ]

"""Weight payloads for /update_weights_from_tensor, in the serialised form SGLang accepts.

SGLang takes `serialized_named_tensors`: one entry per TP rank, each the base64 text of a
list of (name, tensor) pickled by multiprocessing's ForkingPickler with torch's reducers, so
that a tensor travels as a shared-memory handle rather than as bytes. On CPU the handle is a
file-system shared-memory name (torch's "file_system" sharing strategy); file descriptors
cannot cross an HTTP request.

Pickle runs code, so the decoder only resolves the handful of torch rebuild functions, storage
classes and dtypes such a payload needs; any other global is refused with an error naming it.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

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


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
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


def encode_named_tensors(
    named: list[tuple[str, torch.Tensor]], keep_alive: list[torch.Tensor] | None = None
) -> str:
    """The trainer side: one rank's `serialized_named_tensors` entry (base64 text).

    Each tensor is copied into fresh shared memory (sharing a live parameter in place would
    move the trainer's own storage, and torch reuses a storage's shared-memory name, which the
    engine may already have released). Pass `keep_alive` and keep it until the engine has
    answered: the shared copies are appended there, and freeing them unlinks the memory.
    """
    with _file_system_sharing():
        shared = [(name, t.detach().to("cpu", copy=True).contiguous().share_memory_()) for name, t in named]
        data = bytes(ForkingPickler.dumps(shared))
    if keep_alive is not None:
        keep_alive.extend(t for _, t in shared)
    return base64.b64encode(data).decode("ascii")


def decode_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The engine side: copy the tensors a payload refers to. Raises PayloadRejected."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadRejected(f"serialized_named_tensors is not valid base64: {e}") from e
    try:
        obj = _TensorUnpickler(io.BytesIO(data)).load()
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
    return [(name, tensor.clone()) for name, tensor in obj]

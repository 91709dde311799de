"""Reading HF safetensors checkpoints at the byte level, and tether's version marker inside them.

Deltas are byte-level and dtype-blind, so this module exposes each tensor as a window of raw
bytes of its shard file (from the safetensors header: 8-byte little-endian length, then JSON).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import msgspec
import numpy as np
import torch

from tether.sync.checksum import checksum_fn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
MARKER_NAME = "tether_weights.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEXES = (INDEX_NAME, "pytorch_model.bin.index.json", MARKER_NAME)

TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}
ST_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in ST_TO_TORCH.items()}


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, malformed, or fails its checksums."""


class TensorSlot(msgspec.Struct, frozen=True):
    """Where one tensor's bytes live in its shard file (absolute byte offsets)."""

    dtype: str
    shape: list[int]
    start: int
    end: int


class WeightsMarker(msgspec.Struct, kw_only=True):
    """`tether_weights.json`: the version a checkpoint holds and the checksum of every tensor."""

    format: str = "tether-weights"
    version: int
    checksum: str
    checksums: dict[str, str]


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES


def read_header(path: Path) -> dict[str, TensorSlot]:
    """The tensor table of one safetensors file, with absolute byte offsets."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: truncated safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from exc
    size = path.stat().st_size
    base = 8 + header_len
    slots: dict[str, TensorSlot] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        slot = TensorSlot(entry["dtype"], list(entry["shape"]), base + start, base + end)
        if slot.end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {slot.end} past the file size {size}"
            )
        slots[name] = slot
    return slots


def weight_map(ckpt: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or from the single shard."""
    index = ckpt / INDEX_NAME
    if index.exists():
        try:
            data = json.loads(index.read_text())
            mapping = data["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        return {str(k): str(v) for k, v in mapping.items()}
    if (ckpt / SINGLE_SHARD).exists():
        return dict.fromkeys(read_header(ckpt / SINGLE_SHARD), SINGLE_SHARD)
    raise CheckpointError(f"{ckpt}: no {INDEX_NAME} and no {SINGLE_SHARD}")


def read_marker(ckpt: Path) -> WeightsMarker | None:
    path = ckpt / MARKER_NAME
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=WeightsMarker)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path}: bad weights marker: {exc}") from exc


def checkpoint_version(ckpt: Path, default: int = 0) -> int:
    """The version recorded in the checkpoint's marker; a plain HF checkpoint counts as `default`."""
    marker = read_marker(ckpt)
    return default if marker is None else marker.version


def close_quietly(mm: mmap.mmap) -> None:
    # A caller may still hold an array over the map; then the map closes when that array dies.
    try:
        mm.close()
    except BufferError:
        pass


class CheckpointView:
    """Read-only byte views of every tensor of a checkpoint, backed by mmaps of its shards."""

    def __init__(self, ckpt: Path, stack: ExitStack) -> None:
        self.root = ckpt
        self.weight_map = weight_map(ckpt)
        self.slots: dict[str, TensorSlot] = {}
        self._maps: dict[str, mmap.mmap] = {}
        for shard in sorted(set(self.weight_map.values())):
            path = ckpt / shard
            if not path.exists():
                raise CheckpointError(f"{ckpt}: shard {shard!r} named in the index is missing")
            header = read_header(path)
            with open(path, "rb") as f:
                size = path.stat().st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            if mm is not None:
                stack.callback(close_quietly, mm)
                self._maps[shard] = mm
            for name, slot in header.items():
                if self.weight_map.get(name) == shard:
                    self.slots[name] = slot
        missing = sorted(set(self.weight_map) - set(self.slots))
        if missing:
            raise CheckpointError(f"{ckpt}: tensors in the index but not in their shard: {missing[:5]}")

    def bytes_of(self, name: str) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 array (no copy)."""
        slot = self.slots[name]
        mm = self._maps.get(self.weight_map[name])
        if mm is None or slot.end == slot.start:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mm, dtype=np.uint8, count=slot.end - slot.start, offset=slot.start)

    def shard_bytes(self, shard: str) -> np.ndarray:
        """The whole shard file as a read-only uint8 array (no copy)."""
        mm = self._maps.get(shard)
        if mm is None:
            if shard not in set(self.weight_map.values()):
                raise CheckpointError(f"{self.root}: no shard {shard!r}")
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mm, dtype=np.uint8)

    def tensor(self, name: str) -> torch.Tensor:
        """A torch copy of one tensor (dtype and shape from the header)."""
        slot = self.slots[name]
        raw = torch.frombuffer(bytearray(self.bytes_of(name).tobytes()), dtype=torch.uint8)
        return raw.view(ST_TO_TORCH[slot.dtype]).reshape(slot.shape).clone()

    def total_bytes(self) -> int:
        return sum(s.end - s.start for s in self.slots.values())


@contextmanager
def open_checkpoint(ckpt: Path) -> Iterator[CheckpointView]:
    with ExitStack() as stack:
        yield CheckpointView(ckpt, stack)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a uint8 numpy array (a view when it is contiguous)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def verify_checkpoint(ckpt: Path) -> WeightsMarker:
    """Check every tensor of a checkpoint against its marker's checksums; raise CheckpointError if not."""
    marker = read_marker(ckpt)
    if marker is None:
        raise CheckpointError(f"{ckpt}: no {MARKER_NAME}; it is not a tether-published checkpoint")
    digest = checksum_fn(marker.checksum)
    with open_checkpoint(ckpt) as view:
        if set(view.slots) != set(marker.checksums):
            extra = sorted(set(view.slots) ^ set(marker.checksums))
            raise CheckpointError(f"{ckpt}: tensors and marker checksums differ: {extra[:5]}")
        for name in sorted(view.slots):
            got = digest(view.bytes_of(name))
            if got != marker.checksums[name]:
                raise CheckpointError(
                    f"{ckpt}: tensor {name!r} checksum {got} != recorded {marker.checksums[name]}"
                )
    return marker

"""Reading HF safetensors checkpoints at the byte level, and tether's version marker inside them.

Deltas are byte-level and dtype-blind, so this module exposes each tensor as a window of raw
bytes of its shard file (from the safetensors header: 8-byte little-endian length, then JSON).

Everything read from a checkpoint's files is checked before use: shard names from the index stay
inside the checkpoint directory, and each header is validated by the safetensors library (known
dtypes, shape × dtype size equal to the byte range, ranges contiguous and inside the file).
tether's marker also records every tensor's header entry, so a header edited in a way that still
parses (a same-size dtype, permuted dimensions) fails verification too.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from tether.runtime.files.safe_paths import contained
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
# The safetensors format caps the JSON header at 100 MB; a larger length is a damaged file.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, malformed, or fails its checksums."""


class TensorSlot(msgspec.Struct, frozen=True):
    """Where one tensor's bytes live in its shard file (absolute byte offsets)."""

    dtype: str
    shape: list[int]
    start: int
    end: int


class WeightsMarker(msgspec.Struct, kw_only=True):
    """`tether_weights.json`: the version a checkpoint holds, the checksum of every tensor, and
    every tensor's header entry (dtype, shape, byte range): the checksums cover bytes only.
    Markers written before `layout` existed have none and are checked without it."""

    format: str = "tether-weights"
    version: int
    checksum: str
    checksums: dict[str, str]
    layout: dict[str, TensorSlot] = msgspec.field(default_factory=dict)


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES


def read_header(path: Path) -> dict[str, TensorSlot]:
    """The tensor table of one safetensors file, with absolute byte offsets.

    Raises CheckpointError naming the file (and the tensor and field where it can) unless the
    header is one the safetensors library accepts: readers and engines load it the same way.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: truncated safetensors header")
            (header_len,) = struct.unpack("<Q", raw_len)
            # Checked before reading: a damaged length would otherwise allocate that much.
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{path}: safetensors header length {header_len} exceeds the file ({size} bytes)"
                    f" or the format's {MAX_HEADER_BYTES}-byte limit"
                )
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + header_len
    slots: dict[str, TensorSlot] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        slots[name] = slot = _slot(path, name, entry, base)
        if slot.end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {slot.end} past the file size {size}"
            )
    try:
        # The library's own validation (dtype names, contiguous ranges covering the data): what
        # it refuses, an engine could not load either.
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: invalid safetensors header: {exc}") from exc
    return slots


def _slot(path: Path, name: str, entry: Any, base: int) -> TensorSlot:
    """One header entry as a TensorSlot, its byte range checked against dtype × shape."""
    try:
        dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = isinstance(dtype, str) and all(isinstance(x, int) and x >= 0 for x in [*shape, start, end])
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {entry!r}")
    itemsize = ST_ITEMSIZE.get(dtype)
    if itemsize is not None and end - start != itemsize * math.prod(shape):
        raise CheckpointError(
            f"{path}: tensor {name!r}: shape={shape} of {dtype} is {itemsize * math.prod(shape)} bytes, "
            f"but data_offsets=[{start}, {end}] hold {end - start}"
        )
    return TensorSlot(dtype, list(shape), base + start, base + end)


def weight_map(ckpt: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or from the single shard."""
    index = ckpt / INDEX_NAME
    if index.exists():
        try:
            data = json.loads(index.read_text())
            mapping = data["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        if not isinstance(mapping, dict):
            raise CheckpointError(f"{index}: weight_map is not an object")
        for name, shard in mapping.items():
            # Every reader joins these names to ckpt: one leaving it could read or overwrite anything.
            contained(ckpt, shard, entry=f"{INDEX_NAME} weight_map[{name!r}]", error=CheckpointError)
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
            path = contained(ckpt, shard, entry=f"{INDEX_NAME} shard", error=CheckpointError)
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


def check_layout(where: Path, slots: dict[str, TensorSlot], recorded: dict[str, TensorSlot]) -> None:
    """Refuse (CheckpointError naming the tensor) headers that differ from the recorded layout;
    an empty record (a marker from before layouts were recorded) checks nothing."""
    if not recorded:
        return
    if set(slots) != set(recorded):
        extra = sorted(set(slots) ^ set(recorded))
        raise CheckpointError(f"{where}: tensors and the recorded layout differ: {extra[:5]}")
    for name in sorted(slots):
        got, want = slots[name], recorded[name]
        if got != want:
            raise CheckpointError(
                f"{where}: tensor {name!r}: the safetensors header says {got.dtype}{got.shape} at bytes "
                f"[{got.start}, {got.end}), the marker recorded {want.dtype}{want.shape} at "
                f"[{want.start}, {want.end})"
            )


def verify_checkpoint(ckpt: Path) -> WeightsMarker:
    """Check every tensor of a checkpoint against its marker (header layout and checksums);
    raise CheckpointError if not."""
    marker = read_marker(ckpt)
    if marker is None:
        raise CheckpointError(f"{ckpt}: no {MARKER_NAME}; it is not a tether-published checkpoint")
    digest = checksum_fn(marker.checksum)
    with open_checkpoint(ckpt) as view:
        check_layout(ckpt, view.slots, marker.layout)
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

"""The on-disk delta format: a self-describing index plus concatenated zstd frames.

A delta directory `delta_v{N:06d}/` holds `delta_index.json` and `delta-00000.bin`. The index
names the version it produces and the base it must be applied to, the encoding, compression and
checksum algorithm, the full checkpoint's weight map, and per tensor: dtype, shape, the checksum
of its base bytes and of its new bytes, and the frames that patch it. Unchanged tensors have no
frames. Each frame covers the element range [start, start+count) of one tensor and carries one op:
  xor        payload = new ^ base over the range (raw bytes, so dtype-blind)
  overwrite  payload = uint32 gaps between changed element positions, then the new values
  full       payload = the new bytes of the range (overwrite falls back to it when it is smaller)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from tether.runtime.files.safe_paths import contained

DELTA_INDEX = "delta_index.json"
FORMAT_NAME = "tether-weight-delta"
FORMAT_VERSION = 1


class DeltaFormatError(ValueError):
    """A delta directory is malformed, truncated or corrupted."""


class DeltaFrame(msgspec.Struct, frozen=True, kw_only=True):
    op: Literal["xor", "overwrite", "full"]
    file: str
    offset: int
    length: int
    start: int
    count: int
    raw_length: int
    n_changed: int
    digest: str


class DeltaTensor(msgspec.Struct, kw_only=True):
    dtype: str
    shape: list[int]
    nbytes: int
    shard: str
    checksum: str
    base_checksum: str
    frames: list[DeltaFrame] = msgspec.field(default_factory=list)


class DeltaIndex(msgspec.Struct, kw_only=True):
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    version: int
    base_version: int
    encoding: Literal["xor", "overwrite"]
    compression: Literal["zstd"] = "zstd"
    compression_level: int = 1
    checksum: str
    frame_checksum: str = "xxh3-64"
    weight_map: dict[str, str]
    tensors: dict[str, DeltaTensor]
    full_bytes: int
    delta_bytes: int

    def changed(self) -> list[str]:
        return [name for name, t in self.tensors.items() if t.frames]


def delta_dir_name(version: int) -> str:
    return f"delta_v{version:06d}"


def read_index(delta_dir: Path) -> DeltaIndex:
    """Read and sanity-check a delta's index; raise DeltaFormatError naming the problem."""
    path = Path(delta_dir) / DELTA_INDEX
    if not path.exists():
        raise DeltaFormatError(f"{delta_dir}: no {DELTA_INDEX}; not a delta directory")
    try:
        index = msgspec.json.decode(path.read_bytes(), type=DeltaIndex)
    except msgspec.DecodeError as exc:
        raise DeltaFormatError(f"{path}: malformed delta index: {exc}") from exc
    if index.format != FORMAT_NAME or index.format_version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"{path}: format={index.format!r} format_version={index.format_version}; "
            f"this tether reads {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    if index.version <= index.base_version:
        raise DeltaFormatError(
            f"{path}: version={index.version} is not after base_version={index.base_version}"
        )
    if index.compression != "zstd":
        raise DeltaFormatError(f"{path}: compression={index.compression!r} is not supported")
    for name, shard in index.weight_map.items():
        # Appliers join shard names to the target and to the new version's staging directory.
        contained(Path(delta_dir), shard, entry=f"weight_map[{name!r}]", error=DeltaFormatError)
    for name, t in index.tensors.items():
        if index.weight_map.get(name) != t.shard:
            raise DeltaFormatError(f"{path}: tensor {name!r} shard {t.shard!r} disagrees with the weight map")
    return index


def write_index(delta_dir: Path, index: DeltaIndex) -> None:
    (Path(delta_dir) / DELTA_INDEX).write_bytes(msgspec.json.format(msgspec.json.encode(index)))

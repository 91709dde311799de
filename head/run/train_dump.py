"""--save-debug-train-data: what each optimizer step of a rollout trained on, every data-parallel
rank's shard, in one versioned msgpack file per rollout (arrays as dtype, shape and raw bytes;
never pickle). `--dump-details DIR` turns it on with slime's layout (`DIR/train_data/{rollout_id}`).

The path may hold `{rollout_id}` and, as slime's, the single writer's `{rank}` (the head: 0).
`load_train_data` reads a file back with numpy arrays.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tether.runtime.files.atomic_file import write_bytes_atomic

DUMP_FORMAT = "tether.debug_train"
DUMP_VERSION = 1


class DebugTrainDumpError(ValueError):
    """A file is missing, not a tether train dump, or of a version this tether cannot read."""


class Array(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes


class TrainDump(msgspec.Struct, kw_only=True):
    format: str = DUMP_FORMAT
    version: int = DUMP_VERSION
    rollout_id: int
    steps: list[list[dict[str, Any]]]
    """Per optimizer step, per DP rank: the shard's columns (see tether.train.rank.batching.TrainBatch)."""


def dump_path(template: str | os.PathLike[str], rollout_id: int) -> Path:
    return Path(os.fspath(template).format(rollout_id=rollout_id, rank=0))


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return Array(dtype=array.dtype.str, shape=list(array.shape), data=array.tobytes())
    raise NotImplementedError(f"cannot dump {type(value).__name__}")


def save_train_data(template: str, rollout_id: int, steps: Sequence[Sequence[msgspec.Struct]]) -> Path:
    """Write one rollout's steps (each a list of per-DP-rank shards) atomically; returns the path."""
    record = TrainDump(
        rollout_id=rollout_id,
        steps=[[msgspec.structs.asdict(shard) for shard in step] for step in steps],
    )
    path = dump_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, msgspec.msgpack.encode(record, enc_hook=_encode))
    return path


def _decode_arrays(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"dtype", "shape", "data"} and isinstance(value["data"], bytes):
            return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        return {k: _decode_arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_arrays(v) for v in value]
    return value


def load_train_data(path: str | os.PathLike[str]) -> TrainDump:
    """A dump written by `save_train_data`, its arrays as numpy arrays."""
    try:
        raw = msgspec.msgpack.decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise DebugTrainDumpError(f"{path}: cannot read a train dump: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != DUMP_FORMAT:
        raise DebugTrainDumpError(f"{path}: not a tether train dump (format {DUMP_FORMAT!r})")
    if raw.get("version") != DUMP_VERSION:
        raise DebugTrainDumpError(f"{path}: version {raw.get('version')!r}; this tether reads {DUMP_VERSION}")
    return TrainDump(rollout_id=raw["rollout_id"], steps=_decode_arrays(raw["steps"]))

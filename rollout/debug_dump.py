"""Rollout dumps for debugging: each rollout's Samples in a safe, versioned msgpack file (never pickle).

`--save-debug-rollout-data PATH` writes `PATH.format(rollout_id=N)` after each rollout;
`--load-debug-rollout-data PATH` reads them back instead of generating (train-only replay).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from tether.rollout.sample import Sample
from tether.runtime.files.atomic_file import write_bytes_atomic

DUMP_FORMAT = "tether.debug_rollout"
DUMP_VERSION = 1


class DebugDumpError(ValueError):
    """A dump file is missing, not a tether dump, or of a version we cannot read."""


class RolloutDump(msgspec.Struct, kw_only=True):
    format: str = DUMP_FORMAT
    version: int = DUMP_VERSION
    rollout_id: int
    groups: list[list[Sample]]
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class _Header(msgspec.Struct):
    format: str = ""
    version: int = 0


def dump_path(template: str | os.PathLike[str], rollout_id: int) -> Path:
    text = os.fspath(template)
    return Path(text.format(rollout_id=rollout_id) if "{rollout_id" in text else text)


def save_rollout(
    template: str | os.PathLike[str],
    rollout_id: int,
    groups: list[list[Sample]],
    metrics: dict[str, float] | None = None,
) -> Path:
    """Write one rollout's groups atomically; returns the file written."""
    path = dump_path(template, rollout_id)
    dump = RolloutDump(rollout_id=rollout_id, groups=groups, metrics=dict(metrics or {}))
    write_bytes_atomic(path, msgspec.msgpack.encode(dump))
    return path


def subsample(groups: list[list[Sample]], ratio: float) -> list[list[Sample]]:
    """slime's --load-debug-rollout-data-subsample: of the rollout's n samples (in order), keep the
    first k // 2 and the last -(-k // 2) with k = int(n x ratio), as slime slices its flat list;
    each kept sample stays in its group (a group may come out smaller), empty groups dropped."""
    flat = [(g, s) for g, group in enumerate(groups) for s in range(len(group))]
    k = int(len(flat) * ratio)
    # slime's slices exactly: with k = 0 its `data[-0:]` is the whole list, so all is kept.
    kept = set(flat[: k // 2] + flat[-k // 2 :])
    out = [[s for i, s in enumerate(group) if (g, i) in kept] for g, group in enumerate(groups)]
    return [group for group in out if group]


def load_rollout(template: str | os.PathLike[str], rollout_id: int) -> RolloutDump:
    """Read a dump back; the error names the file and what is wrong with it."""
    path = dump_path(template, rollout_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise DebugDumpError(f"{path}: no rollout dump for rollout {rollout_id}") from exc
    try:
        header = msgspec.msgpack.decode(raw, type=_Header)
    except msgspec.DecodeError as exc:
        raise DebugDumpError(f"{path}: not a tether rollout dump ({exc})") from exc
    if header.format != DUMP_FORMAT:
        raise DebugDumpError(f"{path}: format {header.format!r} is not {DUMP_FORMAT!r}")
    if header.version != DUMP_VERSION:
        raise DebugDumpError(f"{path}: dump version {header.version} is not {DUMP_VERSION}")
    try:
        return msgspec.msgpack.decode(raw, type=RolloutDump)
    except msgspec.DecodeError as exc:
        raise DebugDumpError(f"{path}: malformed rollout dump: {exc}") from exc

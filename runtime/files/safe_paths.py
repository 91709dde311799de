"""Joining file names read from metadata (an index, a delta, a checkpoint's own records) to the
directory they describe, refusing any name that would leave that directory.

The check is lexical: a name must be relative, non-empty, and have no `..` component. Symlinks
are not resolved, on purpose: a Hugging Face hub snapshot links every shard file into a blob
store outside the snapshot directory, and that is the directory owner's choice, not the
metadata's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath

__all__ = ["UnsafePath", "contained"]


class UnsafePath(ValueError):
    """A file name read from metadata is absolute or climbs out of its directory."""


def contained(
    root: Path, name: object, *, entry: str, error: Callable[[str], Exception] = UnsafePath
) -> Path:
    """`root / name`, refused (raising `error(message)`) unless `name` stays inside `root`.

    `entry` says where the name was read, e.g. "model.safetensors.index.json weight_map['x']",
    so the message names the offending entry and its value.
    """
    why = _unsafe(name)
    if why:
        raise error(f"{root}: {entry} = {name!r} {why}; refused (it must name a file inside {root})")
    return Path(root) / str(name)


def _unsafe(name: object) -> str:
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\0" in name:
        return "contains a NUL byte"
    # Backslashes count as separators too: a name written on Windows means a path there.
    if name.startswith(("/", "\\")):
        return "is an absolute path"
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        return "climbs out of its directory (..)"
    if not parts:
        return "names the directory itself"
    return ""

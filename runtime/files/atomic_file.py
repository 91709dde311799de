"""Crash-safe writes: temp, fsync, rename, fsync the parent — for files and whole directories.

A reader never sees a half-written file or directory: either the old one or the complete new one.
This is the one place tether writes files that a crash could leave half done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories make a rename or unlink durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: readers see the old content or the new, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, children before parents."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath, name))
        fsync_path(Path(dirpath))


def temp_dir_for(final: Path) -> Path:
    """The staging directory name for `final`: `<final>.tmp-<pid>`, in the same parent."""
    return final.with_name(f"{final.name}.tmp-{os.getpid()}")


def publish_dir(staging: Path, final: Path) -> None:
    """Make a fully written staging directory visible as `final`, durably.

    If `final` already exists (a version re-published after a crash) it is moved aside first and
    removed after the new one is in place.
    """
    fsync_tree(staging)
    old: Path | None = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory; publish it as `final` on success, remove it on error."""
    staging = temp_dir_for(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_dir(staging, final)


def replace_symlink(link: Path, target: str) -> None:
    """Point `link` at `target` atomically (a new link renamed over the old one)."""
    tmp = link.with_name(f"{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_path(link.parent)

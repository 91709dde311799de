"""The host-local full checkpoint that deltas are applied to (--update-weight-local-checkpoint-dir).

Layout: `<root>/weight_v{N:06d}/` complete checkpoints, `<root>/current` a symlink to the one
engines should load, `<root>/.lock` the file lock that serialises appliers on this host. A delta
is applied into `weight_v{N+1}.tmp-<pid>/` beside the current version (which keeps serving),
verified, renamed into place, and only then does `current` move, so a crash at any point leaves
the store at the old version. The previous version is kept for an engine still reading it; the
version a publish will prune lends its single-link shard files to the apply, which overwrites
them (pages already cached: much faster than allocating new ones when memory is full of cache).
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import msgspec
from filelock import FileLock, Timeout

from tether.sync.atomic import fsync_path, publish_dir, replace_symlink, temp_dir_for
from tether.sync.checkpoint_files import (
    MARKER_NAME,
    CheckpointError,
    WeightsMarker,
    is_weight_file,
    open_checkpoint,
    read_marker,
    verify_checkpoint,
)
from tether.sync.checksum import checksum_fn
from tether.sync.delta import DeltaRefused, apply_delta, resolve_threads, verify_delta
from tether.sync.hf_writer import published_versions, version_dir_name

CURRENT = "current"
LOCK = ".lock"


class StoreError(RuntimeError):
    """The local store is missing, locked too long, or inconsistent."""


class ApplyOutcome(msgspec.Struct, kw_only=True):
    """What one apply/repair/seed did: the version now current and whether anything changed."""

    version: int
    path: str
    changed: bool
    seconds: float
    bytes_read: int = 0


class LocalCheckpointStore:
    """One host's versioned full checkpoint, safe for several appliers racing on the host."""

    def __init__(
        self, root: Path, *, lock_timeout: float = 600.0, threads: int = 0, keep_previous: int = 1
    ) -> None:
        self.root = Path(root)
        self.lock_timeout = lock_timeout
        self.threads = resolve_threads(threads)
        self.keep_previous = keep_previous

    # ---------------------------------------------------------------- reading
    def current_path(self) -> Path | None:
        link = self.root / CURRENT
        if not link.is_symlink():
            return None
        return (self.root / os.readlink(link)).resolve()

    def version(self) -> int | None:
        path = self.current_path()
        if path is None:
            return None
        marker = read_marker(path)
        if marker is None:
            raise StoreError(f"{path}: the current version has no {MARKER_NAME}")
        return marker.version

    def verify(self) -> WeightsMarker:
        path = self.current_path()
        if path is None:
            raise StoreError(f"{self.root}: no current version (seed the store first)")
        return verify_checkpoint(path)

    # ---------------------------------------------------------------- changing (under the lock)
    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / LOCK), timeout=self.lock_timeout)

    def _locked(self) -> FileLock:
        lock = self._lock()
        try:
            lock.acquire()
        except Timeout as exc:
            raise StoreError(
                f"{self.root}: another applier held {LOCK} for over {self.lock_timeout}s"
            ) from exc
        return lock

    def _clean_staging(self) -> None:
        # Under the lock nobody else is writing here: leftovers are from crashed appliers.
        for entry in self.root.iterdir():
            if ".tmp-" in entry.name or ".old-" in entry.name:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _publish(self, staging: Path, version: int) -> Path:
        final = self.root / version_dir_name(version)
        publish_dir(staging, final)
        replace_symlink(self.root / CURRENT, final.name)
        self._prune(version)
        return final

    def _prune(self, current: int) -> None:
        versions = sorted(v for v in published_versions(self.root) if v != current)
        older = [v for v in versions if v < current]
        keep = set(older[-self.keep_previous :]) if self.keep_previous else set()
        for v, path in published_versions(self.root).items():
            if v != current and v not in keep:
                shutil.rmtree(path, ignore_errors=True)
        fsync_path(self.root)

    def _set_aside_doomed(self, current: int) -> Path | None:
        """Move the oldest version that the next publish would prune out of the way (renamed to
        `.old-<pid>`, which _clean_staging removes after a crash) so its files can be reused.

        Safe because the ledger publishes version N+1 only after every engine serves N, so no
        engine reads a version older than the current one's predecessors kept by keep_previous.
        """
        older = sorted(v for v in published_versions(self.root) if v < current)
        kept_after = set(older[-(self.keep_previous - 1) :]) if self.keep_previous > 1 else set()
        doomed = [v for v in older if v not in kept_after]
        if not doomed:
            return None
        path = published_versions(self.root)[doomed[0]]
        aside = path.with_name(f"{path.name}.old-{os.getpid()}")
        os.rename(path, aside)
        fsync_path(self.root)
        return aside

    def seed(self, source: Path, *, version: int | None = None, checksum: str = "xxh3-128") -> ApplyOutcome:
        """Make a full checkpoint the store's current version (a no-op if the store already has one).

        A plain HF checkpoint becomes `version` (default: its marker's version, else 0).
        """
        start = time.perf_counter()
        with self._locked():
            self._clean_staging()
            current = self.version()
            if current is not None:
                return ApplyOutcome(
                    version=current, path=str(self.current_path()), changed=False, seconds=0.0
                )
            return self._install_full(Path(source), version, checksum, start)

    def repair(self, full: Path, *, checksum: str = "xxh3-128") -> ApplyOutcome:
        """Replace whatever the store holds with a verified full checkpoint (for a broken chain)."""
        start = time.perf_counter()
        with self._locked():
            self._clean_staging()
            marker = verify_checkpoint(Path(full))
            if self.version() == marker.version:
                cur = self.current_path()
                assert cur is not None
                try:
                    verify_checkpoint(cur)
                    return ApplyOutcome(version=marker.version, path=str(cur), changed=False, seconds=0.0)
                except CheckpointError:
                    pass  # the local copy of this version is damaged: reinstall it
            return self._install_full(Path(full), marker.version, checksum, start)

    def _install_full(self, source: Path, version: int | None, checksum: str, start: float) -> ApplyOutcome:
        marker = read_marker(source)
        if version is None:
            version = 0 if marker is None else marker.version
        final = self.root / version_dir_name(version)
        staging = temp_dir_for(final)
        staging.mkdir(parents=True)
        try:
            for entry in sorted(source.iterdir()):
                if entry.is_file() and entry.name != MARKER_NAME and not entry.name.startswith("."):
                    shutil.copyfile(entry, staging / entry.name)
            digest = checksum_fn(checksum if marker is None else marker.checksum)
            with open_checkpoint(staging) as view:
                sums = {name: digest(view.bytes_of(name)) for name in sorted(view.slots)}
                nbytes = view.total_bytes()
            if marker is not None and sums != marker.checksums:
                bad = sorted(n for n in sums if sums[n] != marker.checksums.get(n))
                raise CheckpointError(f"{source}: copied tensors fail their recorded checksums: {bad[:5]}")
            new_marker = WeightsMarker(
                version=version, checksum=checksum if marker is None else marker.checksum, checksums=sums
            )
            (staging / MARKER_NAME).write_bytes(msgspec.json.encode(new_marker))
            path = self._publish(staging, version)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return ApplyOutcome(
            version=version,
            path=str(path),
            changed=True,
            seconds=time.perf_counter() - start,
            bytes_read=nbytes,
        )

    def apply(self, delta_dir: Path) -> ApplyOutcome:
        """Apply one delta under the lock; idempotent; raises DeltaRefused leaving the store as it was."""
        start = time.perf_counter()
        delta_dir = Path(delta_dir)
        with self._locked():
            self._clean_staging()
            current = self.version()
            cur_path = self.current_path()
            if current is None or cur_path is None:
                raise StoreError(
                    f"{self.root}: no current version to apply {delta_dir} to (seed the store first)"
                )
            index = verify_delta(delta_dir)
            if current == index.version:
                # Already there (another applier won the race, or a retry): never a second XOR.
                return ApplyOutcome(version=current, path=str(cur_path), changed=False, seconds=0.0)
            if current > index.version:
                raise DeltaRefused(
                    f"{self.root} is at version {current}, newer than the delta's version {index.version}"
                )
            final = self.root / version_dir_name(index.version)
            staging = temp_dir_for(final)
            staging.mkdir(parents=True)
            aside = self._set_aside_doomed(current)
            reuse: dict[str, Path] = {}
            try:
                reuse = _reusable_shards(aside)
                apply_delta(
                    cur_path, current, delta_dir, staging, threads=self.threads, index=index, reuse=reuse
                )
                path = self._publish(staging, index.version)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                if aside is not None and all(p.exists() for p in reuse.values()):
                    # Refused before any of its files were taken (a wrong base, say): put it back.
                    os.rename(aside, aside.with_name(aside.name.rsplit(".old-", 1)[0]))
                    aside = None
                raise
            finally:
                if aside is not None:
                    shutil.rmtree(aside, ignore_errors=True)
            return ApplyOutcome(
                version=index.version,
                path=str(path),
                changed=True,
                seconds=time.perf_counter() - start,
                bytes_read=index.delta_bytes,
            )


def _reusable_shards(doomed: Path | None) -> dict[str, Path]:
    """Shard files of a doomed version that no other version shares (hard links are shared)."""
    if doomed is None:
        return {}
    found: dict[str, Path] = {}
    for entry in doomed.iterdir():
        st = entry.lstat()
        if entry.name.endswith(".safetensors") and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            found[entry.name] = entry
    return found


def is_store(path: Path) -> bool:
    return (Path(path) / CURRENT).is_symlink()


def is_checkpoint(path: Path) -> bool:
    return Path(path).is_dir() and any(is_weight_file(p.name) for p in Path(path).iterdir())


__all__ = ["ApplyOutcome", "LocalCheckpointStore", "StoreError", "is_checkpoint", "is_store"]

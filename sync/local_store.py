"""The host-local full checkpoint that deltas are applied to (--update-weight-local-checkpoint-dir).

Layout: `<root>/weight_v{N:06d}/` complete checkpoints, `<root>/current` a symlink to the one
engines should load, `<root>/.lock` the file lock that serialises appliers on this host. A delta
is applied into `weight_v{N+1}.tmp-<pid>/` beside the current version (which keeps serving),
verified, renamed into place, and only then does `current` move, so a crash at any point leaves
the store at the old version. The previous version is kept for an engine still reading it and
is pruned only after the new version is published: an apply refused at any point, however
late (a result that fails its checksums), leaves every version the store held untouched.

Each version is built aside at the cost of what changed (tether.sync.delta.apply_delta): files
without a changed tensor are reflinks or hard links of the previous version's, and every file
of a version is read-only, never written again, only replaced by the next version's new file.
Pruning renames the dropped versions aside (`.old-`) under the lock and leaves their removal to
the store's pruner thread, off the apply's path; `close()` (or leaving the store's `with`)
waits for it, and a removal cut short by a crash is finished by the next applier.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import msgspec
from filelock import FileLock, Timeout

from tether.runtime.files.atomic_file import fsync_path, publish_dir, replace_symlink, temp_dir_for
from tether.runtime.files.safe_paths import contained
from tether.sync.checkpoint_files import (
    MARKER_NAME,
    CheckpointError,
    WeightsMarker,
    check_layout,
    is_weight_file,
    open_checkpoint,
    read_marker,
    verify_checkpoint,
)
from tether.sync.checksum import checksum_fn
from tether.sync.delta import (
    DeltaRefused,
    apply_delta,
    clone_file,
    make_read_only,
    resolve_threads,
    verify_delta,
)
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
        self,
        root: Path,
        *,
        lock_timeout: float = 600.0,
        threads: int = 0,
        keep_previous: int = 1,
        prune_in_background: bool = True,
    ) -> None:
        self.root = Path(root)
        self.lock_timeout = lock_timeout
        self.threads = resolve_threads(threads)
        self.keep_previous = keep_previous
        self.prune_in_background = prune_in_background
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: list[Future[None]] = []
        self._retired: set[Path] = set()  # renamed-aside versions the pruner has yet to remove

    def __enter__(self) -> LocalCheckpointStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def wait_pruned(self) -> None:
        """Return once every version this store pruned is removed from disk (raising what the
        removal raised)."""
        while self._pruning:
            self._pruning.pop(0).result()

    def close(self) -> None:
        """Wait for the pruner and stop it; the store stays usable (pruning then runs inline)."""
        try:
            self.wait_pruned()
        finally:
            if self._pruner is not None:
                self._pruner.shutdown(wait=True)
                self._pruner = None

    # ---------------------------------------------------------------- reading
    def current_path(self) -> Path | None:
        link = self.root / CURRENT
        if not link.is_symlink():
            return None
        # tether points it at a version beside it; anything else was not written by a store.
        target = contained(self.root, os.readlink(link), entry=f"{CURRENT} link", error=StoreError)
        return target.resolve()

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
            if entry in self._retired:
                continue  # this store's pruner is removing it
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
        dropped: list[Path] = []
        for v, path in published_versions(self.root).items():
            if v != current and v not in keep:
                # Renamed aside first (cheap, atomic): no longer a version for any reader or
                # applier; removing its files (costly: a version's pages and blocks) comes after.
                aside = path.with_name(f"{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.rename(path, aside)
                dropped.append(aside)
        fsync_path(self.root)
        if not dropped:
            return
        if not self.prune_in_background:
            self._remove(dropped)
            return
        self._pruning = [f for f in self._pruning if not f.done() or f.exception() is not None]
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="store-prune")
        self._retired.update(dropped)
        self._pruning.append(self._pruner.submit(self._remove, dropped))

    def _remove(self, dropped: list[Path]) -> None:
        for path in dropped:
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                self._retired.discard(path)

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
                    # A reflink or a copy, never a hard link: the source is not the store's to freeze.
                    fd = clone_file(entry, staging / entry.name)
                    if fd is None:
                        shutil.copyfile(entry, staging / entry.name)
                    else:
                        os.close(fd)
                    make_read_only(staging / entry.name)
            digest = checksum_fn(checksum if marker is None else marker.checksum)
            with open_checkpoint(staging) as view:
                # The copy's headers (checked by open_checkpoint) against the source's record.
                check_layout(source, view.slots, marker.layout if marker is not None else {})
                sums = {name: digest(view.bytes_of(name)) for name in sorted(view.slots)}
                nbytes = view.total_bytes()
                layout = dict(view.slots)
            if marker is not None and sums != marker.checksums:
                bad = sorted(n for n in sums if sums[n] != marker.checksums.get(n))
                raise CheckpointError(f"{source}: copied tensors fail their recorded checksums: {bad[:5]}")
            new_marker = WeightsMarker(
                version=version,
                checksum=checksum if marker is None else marker.checksum,
                checksums=sums,
                layout=layout,
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
            try:
                # Built entirely aside, in new files: no version the store holds is touched
                # until the result has passed every check and is published.
                apply_delta(cur_path, current, delta_dir, staging, threads=self.threads, index=index)
                path = self._publish(staging, index.version)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return ApplyOutcome(
                version=index.version,
                path=str(path),
                changed=True,
                seconds=time.perf_counter() - start,
                bytes_read=index.delta_bytes,
            )


def is_store(path: Path) -> bool:
    return (Path(path) / CURRENT).is_symlink()


def is_checkpoint(path: Path) -> bool:
    return Path(path).is_dir() and any(is_weight_file(p.name) for p in Path(path).iterdir())


__all__ = ["ApplyOutcome", "LocalCheckpointStore", "StoreError", "is_checkpoint", "is_store"]

"""The weight-version ledger: one JSON line per sync, appended durably.

A sync publishes version N+1 only after every engine reported serving N; `begin` enforces that
order and `record` appends the finished entry (version, transport, bytes moved, pause time and
every engine's served version). Each entry is one `write` of a whole line followed by fsync, so a
crash leaves whole lines; a torn last line from a crash mid-write is ignored when reading.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from tether.runtime.files.atomic_file import fsync_path


class LedgerError(RuntimeError):
    """A sync was started out of order, or the ledger file cannot be read."""


class LedgerEntry(msgspec.Struct, kw_only=True):
    version: int
    transport: str
    bytes_moved: int
    pause_seconds: float
    total_seconds: float
    engine_versions: dict[str, int | None]
    started_at: float
    finished_at: float
    ok: bool = True
    note: str = ""

    @classmethod
    def finished(
        cls,
        *,
        version: int,
        transport: str,
        bytes_moved: int,
        pause_seconds: float,
        perf_started: float,
        started_at: float,
        engine_versions: dict[str, int | None],
        note: str = "",
    ) -> LedgerEntry:
        """The entry of a sync that just ended: ok when every engine reports `version`."""
        return cls(
            version=version,
            transport=transport,
            bytes_moved=bytes_moved,
            pause_seconds=pause_seconds,
            total_seconds=time.perf_counter() - perf_started,
            engine_versions=engine_versions,
            started_at=started_at,
            finished_at=time.time(),
            ok=all(v == version for v in engine_versions.values()),
            note=note,
        )


class VersionLedger:
    """The head's record of which weight version every engine serves."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.entries: list[LedgerEntry] = self._read()

    def _read(self) -> list[LedgerEntry]:
        if not self.path.exists():
            return []
        entries = []
        lines = self.path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                entries.append(msgspec.json.decode(line, type=LedgerEntry))
            except msgspec.DecodeError as exc:
                if i == len(lines) - 1:
                    break  # a torn final line from a crash mid-append
                raise LedgerError(f"{self.path}: line {i + 1} is not a ledger entry: {exc}") from exc
        return entries

    @property
    def version(self) -> int:
        """The last version every engine confirmed (0 before the first sync)."""
        for entry in reversed(self.entries):
            if entry.ok:
                return entry.version
        return 0

    def record(self, entry: LedgerEntry) -> None:
        """Append one entry durably."""
        if entry.ok:
            stale = {n: v for n, v in entry.engine_versions.items() if v != entry.version}
            if stale:
                raise LedgerError(f"version {entry.version} recorded as done but engines report {stale}")
        line = msgspec.json.encode(entry) + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new_file = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if new_file:
            fsync_path(self.path.parent)
        self.entries.append(entry)


def now() -> float:
    return time.time()

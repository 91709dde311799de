"""A run's directory: receipt, metrics and event logs, per-process logs, checkpoints, weights.

<run_dir>/receipt.json     resolved config, placement plan, package versions, git revision, hosts
<run_dir>/metrics.jsonl    one JSON object per step (and per evaluation)
<run_dir>/events.jsonl     what happened when: starts, exits, restarts, syncs, checkpoints
<run_dir>/ledger.jsonl     the weight-sync ledger
<run_dir>/logs/            one log per process
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from tether.runtime.atomic_file import write_bytes_atomic as atomic_write_bytes


def default_run_dir(root: Path = Path("runs")) -> Path:
    return root / time.strftime("%Y%m%d-%H%M%S")


def package_versions() -> dict[str, str]:
    """Every installed distribution and its version."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name] = dist.version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def git_revision() -> str | None:
    """The revision of the tether checkout this code runs from, if it is one."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class RunDir:
    """Owns the files of one run; every write is atomic or an append of whole lines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.logs = path / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.receipt_path = path / "receipt.json"
        self.metrics_path = path / "metrics.jsonl"
        self.events_path = path / "events.jsonl"
        self.ledger_path = path / "ledger.jsonl"
        self.samples_path = path / "samples.jsonl"

    def write_receipt(
        self, config: Any, plan: Any, *, argv: list[str], extra: dict[str, Any] | None = None
    ) -> None:
        receipt = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": argv,
            "config": msgspec.to_builtins(config),
            "plan": msgspec.to_builtins(plan),
            "versions": {"python": platform.python_version(), **package_versions()},
            "git_revision": git_revision(),
            "hosts": {
                "head": socket.gethostname(),
                "platform": platform.platform(),
                "executable": sys.executable,
            },
            **(extra or {}),
        }
        atomic_write_bytes(self.receipt_path, json.dumps(receipt, indent=2, default=str).encode())

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        # One write of one whole line: a crash can lose the line but never leaves half of it
        # followed by more data; readers skip a torn last line.
        line = json.dumps(record, default=float, allow_nan=True) + "\n"
        with open(path, "a") as f:
            f.write(line)
            f.flush()

    def metric(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_path, {"time": time.time(), **record})

    def trained_samples(self, record: dict[str, Any]) -> None:
        self._append(self.samples_path, record)

    def event(self, kind: str, **fields: Any) -> None:
        self._append(self.events_path, {"time": time.time(), "event": kind, **fields})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file, skipping a torn last line left by a crash."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

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

from tether.runtime.files.atomic_file import write_bytes_atomic


def default_run_dir(root: Path = Path("runs")) -> Path:
    return root / time.strftime("%Y%m%d-%H%M%S")


def package_versions() -> dict[str, str]:
    """Every installed distribution and its version."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name, version = name_and_version(dist)
        if name:
            found[name] = version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def name_and_version(dist: importlib.metadata.Distribution) -> tuple[str | None, str]:
    """A distribution's `Name` and `Version` as its metadata gives them, read from the metadata
    file's first header lines: `dist.metadata` parses the whole file as an email message, ~0.2 ms
    each, some 60 ms of every run's start for a few hundred installed distributions."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    headers: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in headers:
            headers[key] = value.strip()
        if len(headers) == 2:
            return headers["Name"], headers["Version"]
    return dist.metadata["Name"], dist.version  # anything unusual: the email parser's reading


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


# Flags whose values are credentials: the receipt keeps that they were given, not the value.
SECRET_FLAGS = ("--wandb-key",)
REDACTED = "<redacted>"


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the values of SECRET_FLAGS replaced."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        name = token.split("=", 1)[0]
        if hide_next and not token.startswith("--"):
            out.append(REDACTED)
        elif name in SECRET_FLAGS and "=" in token:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(token)
        hide_next = name in SECRET_FLAGS and "=" not in token
    return out


def redact_config(config: Any) -> Any:
    """The config's builtins with the values of SECRET_FLAGS replaced."""
    if isinstance(config, dict):
        for flag in SECRET_FLAGS:
            field = flag[2:].replace("-", "_")
            for section in config.values():
                if isinstance(section, dict) and section.get(field) is not None:
                    section[field] = REDACTED
    return config


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
            "argv": redact_argv(argv),
            "config": redact_config(msgspec.to_builtins(config)),
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
        write_bytes_atomic(self.receipt_path, json.dumps(receipt, indent=2, default=str).encode())

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
        """A step whose optimizer update is in the trainer's weights (never written earlier)."""
        self._append(self.samples_path, record)

    def discard_steps_after(self, rollout_id: int, *, reason: str) -> list[int]:
        """Record every step after `rollout_id` still counted in samples.jsonl as discarded.

        Called on resume from the checkpoint of step `rollout_id`: steps trained after it (the
        head or a rank was killed before their checkpoint) are not in the resumed weights.
        """
        dropped = [step for step in model_steps(read_jsonl(self.samples_path)).steps if step > rollout_id]
        for step in dropped:
            self._append(self.samples_path, {"discarded": step, "resumed_from": rollout_id, "reason": reason})
        return dropped

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


class ModelSteps(msgspec.Struct, frozen=True):
    """What samples.jsonl says is in the model: live steps, discarded ones, and violations."""

    steps: list[int]  # trained and not discarded, in the order they were trained
    discarded: list[int]  # every discard record, in order
    duplicates: list[int]  # a step recorded as trained twice without a discard between: a bug


def model_steps(records: list[dict[str, Any]]) -> ModelSteps:
    """Replay samples.jsonl's records: a "step" record adds, a "discarded" record removes."""
    live: dict[int, None] = {}
    discarded: list[int] = []
    duplicates: list[int] = []
    for record in records:
        if "discarded" in record:
            step = int(record["discarded"])
            discarded.append(step)
            live.pop(step, None)
        elif "step" in record:
            step = int(record["step"])
            if step in live:
                duplicates.append(step)
            live[step] = None
    return ModelSteps(steps=list(live), discarded=discarded, duplicates=duplicates)


def live_metrics(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl's step records without those of steps a resume discarded (trained after
    the checkpoint it resumed from, so not in the model); evaluation records stay."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if "discarded" in record and "step" not in record:
            gone = set(record["discarded"])
            kept = [r for r in kept if r.get("step") not in gone or r["step"] < 0]
        else:
            kept.append(record)
    return kept

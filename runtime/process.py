"""What the supervisor and node agents say about processes: specs, exits, log tails."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
LOG_TAIL_LINES = 30
_LOG_TAIL_BYTES = 16384


class ProcessSpec(msgspec.Struct, kw_only=True):
    """One process to start: a name (also its log file's name), argv, extra environment.

    `env` is laid over the agent's environment (placement supplies CUDA_VISIBLE_DEVICES and
    the rest); the run secret is added by the agent and never travels in a spec. `address` is
    the node's planned address: the agent binds the process's gloo and NCCL sockets to the
    interface holding it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless already set).
    """

    name: str
    argv: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    node: str = "local"
    address: str = ""
    run_secret: bool = True
    """Whether the process gets the run secret (TETHER_SECRET): only those that speak tether's
    RPC need it; an engine or the sglang-router, which anyone may ask to run code paths over
    HTTP, must not hold the key to every actor of the run."""

    def validate(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"process name {self.name!r}: use letters, digits, '_', '.', '-' (at most 128)")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"process {self.name!r}: argv={self.argv!r} must be a non-empty list of strings")


class ExitInfo(msgspec.Struct, kw_only=True):
    """How a process ended: an exit code, or the signal that killed it, and its log's tail.

    Both `returncode` and `signal` are None when the process was lost with its node agent.
    """

    name: str
    node: str = "local"
    pid: int = 0
    returncode: int | None = None
    signal: int | None = None
    log_tail: str = ""
    reason: str = ""


def log_path(run_dir: Path, name: str) -> Path:
    return run_dir / "logs" / f"{name}.log"


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

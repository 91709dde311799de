"""What the supervisor and node agents say about processes: specs, exits, log tails."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
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
    zygote: bool = False
    """Fork the process from one of its node's zygotes (runtime/process/zygote.py), a process that has
    already imported what it needs, instead of starting a fresh interpreter: a few milliseconds
    instead of ~0.2 s (~1.4 CPU-seconds for a CPU engine). A process with `run_secret` comes from
    the runtime zygote, one without from the secret-less zygote, whose memory never holds the
    secret (the runtime zygote's does: requests carry it to its children). Only for
    `[sys.executable, "-m", MODULE, ...]` commands that need no fresh interpreter (not
    torchrun, not SGLang); the process is otherwise the one a spawn gives
    (session, log, environment, cwd, signals, exit status), except that a process it leaves
    behind in its group is killed at once rather than after the grace period. When the zygote
    cannot give that process (an interpreter-start variable such as PYTHONHASHSEED differs from
    the agent's, another interpreter, no zygote), the agent spawns it and logs why."""
    preload: list[str] = msgspec.field(default_factory=list)
    """Modules the zygote imports (once, in itself) before forking this process, so that it and
    later ones start with them imported; a module that cannot be imported there is left to the
    process. They are imported with the zygote's environment and sys.path, not this spec's, must
    not start threads (the zygote then forks nothing more), and whatever state they set up at
    import (a random generator's seed, say) is every child's. Only with `zygote`."""

    def validate(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"process name {self.name!r}: use letters, digits, '_', '.', '-' (at most 128)")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"process {self.name!r}: argv={self.argv!r} must be a non-empty list of strings")
        if self.preload and not self.zygote:
            raise ValueError(f"process {self.name!r}: preload={self.preload!r} applies only with zygote=True")
        bad = [m for m in self.preload if not _MODULE.match(m)]
        if bad:
            raise ValueError(f"process {self.name!r}: preload={bad!r}: not module names")


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

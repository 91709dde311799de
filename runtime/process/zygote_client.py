"""The node agent's side of the zygote (runtime/process/zygote.py): start it, ask it for children, learn
how they end.

    zygote = ZygoteClient(log=run_dir / "logs" / ZYGOTE_LOG, grace=10.0)
    zygote.launch()                      # returns at once; the zygote imports in the background
    child = await zygote.spawn(name=..., argv=[sys.executable, "-m", "mod", ...], env=..., cwd=..., log=...)
    child.send_signal(signal.SIGTERM)    # through its pidfd: never a recycled pid
    returncode = await child.wait()      # exit code, or -N after signal N
    await zygote.close(timeout=15.0)

`spawn` raises ZygoteUnavailable, saying why, whenever the zygote cannot give the same process a
spawn would (`fork_refusal`), is not running, or refused; the agent then spawns it. A zygote
that dies (its children die with it, each reported) is replaced at the next `spawn`, up to
MAX_LAUNCHES launches in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tether.runtime.process import zygote as protocol
from tether.runtime.rpc.secret import SECRET_ENV

log = logging.getLogger(__name__)

ZYGOTE_LOG = "_zygote.log"  # in the run's logs/; no process name can start with "_"
SECRETLESS_ZYGOTE_LOG = "_zygote-secretless.log"
# The secret-less zygote's environment on top of the agent's, which every process it forks must
# also carry: numpy's OpenBLAS starts its thread pool when it loads (a preload importing torch
# loads it), and a zygote with a second thread forks nothing more.
SECRETLESS_ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1"}
READY_TIMEOUT = 60.0  # for the zygote to import the runtime
START_TIMEOUT = 60.0  # for it to fork a child (after the spec's preloads)
MAX_LAUNCHES = 3  # a zygote lost is replaced at the next start, this many launches in all
CMDLINE_ROOM = 384  # blanks on the zygote's command line: a child's is shown in their place
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Read when an interpreter (or libc) starts, or when a native library a preload imports loads
# (OpenMP, OpenBLAS, MKL, torch): a child cannot take a value other than the zygote's.
# PYTHONPATH is the exception, rebuilt in the child; PYTHONUNBUFFERED only matters set or not.
_STARTUP_PREFIXES = (
    "PYTHON",
    "LD_",
    "LC_",
    "MALLOC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
)
_STARTUP_NAMES = ("LANG", "LANGUAGE", "GLIBC_TUNABLES", "TZ")


class ZygoteUnavailable(Exception):
    """The zygote cannot start this process (the message says why); spawn it instead."""


def _startup_variable(key: str) -> bool:
    return key.startswith(_STARTUP_PREFIXES) or key in _STARTUP_NAMES


def zygote_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The zygote's own environment: the agent's, without the run secret (requests carry it to
    the children that get it), unbuffered output as every child of an agent has by default."""
    env = {k: v for k, v in environ.items() if k != SECRET_ENV}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def fork_refusal(argv: Sequence[str], env: Mapping[str, str], base_env: Mapping[str, str]) -> str | None:
    """Why a fork of the zygote (environment `base_env`) would not be the process that spawning
    `argv` with `env` gives; None when it would be."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return f"argv {list(argv[:3])!r} is not [sys.executable, '-m', MODULE, ...] ({sys.executable})"
    if not _MODULE.match(argv[2]):
        return f"{argv[2]!r} is not a module name"
    for key in sorted(set(env) | set(base_env)):
        if not _startup_variable(key) or key == "PYTHONPATH":
            continue
        if key == "PYTHONUNBUFFERED":
            differs = bool(env.get(key)) != bool(base_env.get(key))
        else:
            differs = env.get(key) != base_env.get(key)
        if differs:
            return f"its environment sets {key} (read as an interpreter starts) unlike the zygote's"
    return None


class ZygoteChild:
    """A process the zygote forked: its pid, signals through its pidfd, and how it ended."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.reason = ""
        """Set when the exit status was not reported by the zygote (it died first)."""
        self._pidfd = pidfd
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        """The exit code, or -N when signal N killed it."""
        return await asyncio.shield(self._exit)

    def send_signal(self, sig: int) -> None:
        """Signal the process itself (never another that took its pid); ProcessLookupError
        once it has ended."""
        if self._pidfd < 0:
            raise ProcessLookupError(f"process {self.pid} has ended")
        signal.pidfd_send_signal(self._pidfd, sig)

    def _ended(self, returncode: int, reason: str = "") -> None:
        if self._exit.done():
            return
        self._close_pidfd()
        self.returncode = returncode
        self.reason = reason
        self._exit.set_result(returncode)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class ZygoteClient:
    """One zygote process and its children, for a node agent."""

    def __init__(
        self,
        *,
        log: Path,
        grace: float,
        environ: Mapping[str, str] | None = None,
        runtime_preload: bool = True,
    ) -> None:
        """`runtime_preload` False: the zygote imports nothing up front (`--bare`), only what
        each request's `preload` names."""
        self.log_path = log
        self.grace = grace
        self.env = zygote_environment(os.environ if environ is None else environ)
        self.runtime_preload = runtime_preload
        self.pid = 0
        self.failure = ""
        """Why the zygote cannot serve (not started, exited, refused to start); '' while it can."""
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[None] | None = None
        self._launch: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[ZygoteChild]] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._closing = False
        self.launches = 0

    # -- life ---------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the zygote in the background; `spawn` waits for it to be ready."""
        loop = asyncio.get_running_loop()
        self.launches += 1
        self._ready = loop.create_future()
        self._launch = loop.create_task(self._start(), name="zygote:start")

    def _relaunch(self) -> None:
        """A new zygote after the last one was lost (its children are still reported as they
        go); the old process is killed if it somehow still runs."""
        old = self._proc
        if old is not None and old.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                old.kill()
        log.warning(
            "starting a new zygote (%s; launch %d of %d)", self.failure, self.launches + 1, MAX_LAUNCHES
        )
        self.failure = ""
        self._proc = None
        self.launch()

    async def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [
                sys.executable, "-m", "tether.runtime.process.zygote", "--fd", str(child.fileno()),
                "--parent-pid", str(os.getpid()), "--grace", repr(self.grace),
                "--room", " " * CMDLINE_ROOM,
            ]  # fmt: skip
            if not self.runtime_preload:
                argv.append("--bare")
            with open(self.log_path, "ab") as logf:  # noqa: ASYNC230  # a local log file opens at once
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    pass_fds=[child.fileno()],
                    start_new_session=True,  # a terminal's Ctrl-C reaches the head, which stops us in order
                )
        except Exception as exc:
            parent.close()
            self._lost(f"the zygote could not be started: {exc}")
            return
        finally:
            child.close()
        self._attach(parent, self._proc.pid)

    def _attach(self, sock: socket.socket, pid: int) -> None:
        """Serve through `sock`, the agent's end of the zygote's socketpair."""
        loop = asyncio.get_running_loop()
        if self._ready is None:
            self._ready = loop.create_future()
        self.pid = pid
        sock.setblocking(False)
        self._sock = sock
        loop.add_reader(sock.fileno(), self._readable)

    async def close(self, timeout: float) -> None:  # noqa: ASYNC109  # bounded by its caller's grace
        """Let the zygote stop what it still runs (SIGTERM, grace, SIGKILL) and exit; SIGKILL it
        after `timeout` seconds."""
        self._closing = True
        if self._launch is not None:
            await self._launch  # a moment: it only starts the process
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)  # EOF: the zygote's cue to go
        if self._proc is not None:
            try:
                async with asyncio.timeout(timeout):
                    await self._proc.wait()
            except TimeoutError:
                log.warning(
                    "the zygote (pid %d) did not exit within %g s; killing it", self._proc.pid, timeout
                )
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._sock is not None:
            self._readable()  # the reports it sent before exiting, up to its EOF
        self._lost("the zygote was stopped")
        # Its children die with it (PR_SET_PDEATHSIG); wait for the last reports.
        for child in list(self._children.values()):
            await child.wait()

    # -- starting -----------------------------------------------------------------------------
    async def spawn(
        self,
        *,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        log: str,
        preload: Sequence[str] = (),
    ) -> ZygoteChild:
        """Fork `argv` (`sys.executable -m MODULE ...`) from the zygote with `env` (the whole
        environment), in `cwd`, output appended to `log`. Raises ZygoteUnavailable, saying why,
        when it cannot be done as a spawn would do it."""
        refusal = fork_refusal(argv, env, self.env)
        if refusal is not None:
            raise ZygoteUnavailable(refusal)
        if self._ready is None:
            raise ZygoteUnavailable("the zygote was not launched")
        if self.failure and not self._closing and self.launches < MAX_LAUNCHES:
            self._relaunch()  # a long run outlives an OOM-killed zygote; a zygote that cannot start gives up
        if not self._ready.done():
            try:
                async with asyncio.timeout(READY_TIMEOUT):
                    await asyncio.shield(self._ready)
            except TimeoutError:
                self._lost(f"the zygote was not ready within {READY_TIMEOUT:g} s")
                if self._proc is not None and self._proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        self._proc.kill()
        if self.failure or self._sock is None:
            raise ZygoteUnavailable(self.failure or "the zygote is not running")
        request = protocol.Start(
            id=next(self._ids),
            name=name,
            module=argv[2],
            args=list(argv[3:]),
            env_set={k: v for k, v in env.items() if self.env.get(k) != v},
            env_unset=[k for k in self.env if k not in env],
            cwd=cwd,
            log=log,
            preload=list(preload),
        )
        data = protocol.encode(request)
        if len(data) > protocol.MAX_MESSAGE:
            raise ZygoteUnavailable(f"the request is {len(data)} bytes, over {protocol.MAX_MESSAGE}")
        started: asyncio.Future[ZygoteChild] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = started
        try:
            self._sock.send(data)
        except OSError as exc:  # full (a stuck zygote), too large for the socket, or gone
            del self._pending[request.id]
            raise ZygoteUnavailable(f"the request could not be sent: {exc}") from None
        # Cancelled or late, the entry stays: a child started after all is killed (_on_started).
        try:
            async with asyncio.timeout(START_TIMEOUT):
                return await started
        except TimeoutError:
            raise ZygoteUnavailable(
                f"no answer within {START_TIMEOUT:g} s (a module it preloads hangs?)"
            ) from None

    # -- reports ------------------------------------------------------------------------------
    def _readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, 65536, 1)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(f"the zygote's socket failed: {exc}")
                return
            if not data:
                self._lost("the zygote exited" if self._closing else "the zygote died")
                return
            try:
                report = protocol.decode_report(data)
            except Exception as exc:
                log.error("a bad report from the zygote (%s); ignored", exc)
                for fd in fds:
                    os.close(fd)
                continue
            self._dispatch(report, fds)

    def _dispatch(self, report: protocol.Report, fds: list[int]) -> None:
        if isinstance(report, protocol.Started):
            if not fds:  # not expected (the zygote sends it along); as a fallback, open our own
                try:
                    fds = [os.pidfd_open(report.pid)]
                except OSError as exc:
                    waiter = self._pending.pop(report.id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_exception(ZygoteUnavailable(f"child {report.pid} is out of reach: {exc}"))
                    return
            self._on_started(report, fds[0])
            fds = fds[1:]
        for fd in fds:  # none expected
            os.close(fd)
        if isinstance(report, protocol.Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(report, protocol.Refused):
            waiter = self._pending.pop(report.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(ZygoteUnavailable(f"the zygote refused: {report.reason}"))
        elif isinstance(report, protocol.Exited):
            child = self._children.pop(report.pid, None)
            if child is not None:
                child._ended(report.returncode)

    def _on_started(self, report: protocol.Started, pidfd: int) -> None:
        child = ZygoteChild(report.pid, pidfd)
        self._children[report.pid] = child
        waiter = self._pending.pop(report.id, None)
        if waiter is None or waiter.done():  # its starter gave up waiting: nobody owns it
            with contextlib.suppress(OSError):  # ProcessLookupError: gone already
                child.send_signal(signal.SIGKILL)
            return
        waiter.set_result(child)

    def _lost(self, why: str) -> None:
        """The zygote can no longer serve: fail the starts in flight; each child still running
        (PR_SET_PDEATHSIG kills it) is reported once its pidfd says it is gone."""
        if not self.failure:
            self.failure = why
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(ZygoteUnavailable(why))
        self._pending.clear()
        if self._sock is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for child in list(self._children.values()):
            self._bury(child, why)

    def _bury(self, child: ZygoteChild, why: str) -> None:
        """Report `child` once it has gone, which PR_SET_PDEATHSIG sees to (SIGKILL here too, in
        case its exit was never reported because the zygote died right after reaping it)."""
        pidfd = child._pidfd
        if pidfd < 0:
            return
        zygote = self.pid  # the one that died (another may be launched before the child goes)
        with contextlib.suppress(OSError):  # ProcessLookupError: gone already
            child.send_signal(signal.SIGKILL)
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            self._children.pop(child.pid, None)
            child._ended(-signal.SIGKILL, f"{why} (pid {zygote}) before reporting its exit; killed with it")

        loop.add_reader(pidfd, gone)


__all__ = [
    "ZYGOTE_LOG",
    "ZygoteChild",
    "ZygoteClient",
    "ZygoteUnavailable",
    "fork_refusal",
    "zygote_environment",
]

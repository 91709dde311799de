"""`python -m tether.runtime.process.zygote --fd N --parent-pid P --grace G`: a fork server for the
Python processes a node agent starts with `ProcessSpec.zygote` set.

A fresh `python -m tether.bench.runtime.actor_host` spends ~0.17 s starting the interpreter and importing
asyncio, uvloop, msgspec, ZeroMQ and tether's RPC before it runs a line of its own; a fork of a
process that already imported them costs a few milliseconds. The zygote is that process: the
agent starts it once (see runtime/process/zygote_client.py), it imports the runtime (`RUNTIME_PRELOAD`)
and then forks one child per start request. It never creates an event loop, a ZeroMQ context or
a thread, and it checks before every fork that it still has one thread only: a child gets its
own loop and context, created after the fork.

Protocol: one msgpack message per datagram on a SOCK_SEQPACKET socketpair (fd N).

    agent -> zygote   Start(id, name, module, args, env_set, env_unset, cwd, log, preload)
    zygote -> agent   Ready(pid)                  once, after the runtime is imported
                      Started(id, pid) + pidfd    the child runs; its pidfd rides along (SCM_RIGHTS)
                      Refused(id, reason)         not forked (the agent spawns it instead)
                      Exited(pid, returncode)     a child ended: its exit code, or -signal

A child is what a spawn through the shim gives, minus the shim: its own session and process
group, stdin from /dev/null, stdout and stderr appended to its log, the spec's environment and
working directory, then `-m MODULE ARGS` run as `python -m` runs it (same `sys.argv`, `sys.path[0]`,
PYTHONPATH, `__main__`, exit status and signal death).

Lifetimes (why not make the head a subreaper and double-fork children to it: that would hand the
head every orphan below it, and asyncio reaps only the pids it started; the zygote owns its
children as the shim owns its command, and the agent holds their pidfds):
- each child has PR_SET_PDEATHSIG=SIGKILL: a zygote that dies, even by SIGKILL, takes its
  children with it; the agent sees each pidfd become readable and reports the death;
- the zygote has PR_SET_PDEATHSIG=SIGTERM: when its agent dies (the head, for the local node),
  or closes the socket, or sends SIGTERM, it stops its children as the shim does (SIGTERM,
  `--grace` seconds, SIGKILL to each group), reports them, and exits;
- the zygote is a child subreaper: whatever a child detaches (double fork) is re-parented to it
  and killed when found (after each child's exit, and at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import sys
import time
import types
from typing import NoReturn

import msgspec

from tether.runtime.process.gc_tuning import imports_without_gc
from tether.runtime.process.proc_title import show_as

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MAX_MESSAGE = 1 << 20  # a request larger than this is refused by the agent before sending
# What every Python process of tether imports anyway; modules a spec names come on top.
RUNTIME_PRELOAD = (
    "argparse",
    "asyncio",
    "logging",
    "runpy",
    "uvloop",
    "msgspec",
    "zmq",
    "tether.runtime.rpc.actors",
    "tether.runtime.loop",
    "tether.runtime.rpc.liveness",
    "tether.runtime.process.signals",
    "tether.runtime.rpc.secret",
    "tether.runtime.process.malloc_tuning",
)


class Start(msgspec.Struct, tag=True, kw_only=True):
    """Fork a child that runs `python -m module *args` (agent -> zygote).

    The environment travels as the difference from the zygote's own (`env_set`, `env_unset`).
    """

    id: int
    name: str
    module: str
    args: list[str]
    env_set: dict[str, str]
    env_unset: list[str]
    cwd: str
    log: str
    preload: list[str] = msgspec.field(default_factory=list)


class Ready(msgspec.Struct, tag=True):
    pid: int


class Started(msgspec.Struct, tag=True):
    id: int
    pid: int


class Refused(msgspec.Struct, tag=True):
    id: int
    reason: str


class Exited(msgspec.Struct, tag=True):
    pid: int
    returncode: int
    """The exit code, or -N when signal N killed it (asyncio's convention)."""


Report = Ready | Started | Refused | Exited
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Start)
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode(message: Start | Report) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Start:
    return _request_decoder.decode(data)


def decode_report(data: bytes) -> Report:
    return _report_decoder.decode(data)


def pythonpath_entries(value: str | None, cwd: str) -> list[str]:
    """The sys.path entries a PYTHONPATH value adds, in order, as the interpreter makes them:
    each made absolute against the working directory (an empty one is the directory itself)."""
    if not value:
        return []
    return [os.path.normpath(os.path.join(cwd, p)) for p in value.split(os.pathsep)]


def child_sys_path(current: list[str], pythonpath_count: int, cwd: str, pythonpath: str | None) -> list[str]:
    """`sys.path` of `python -m` started in `cwd` with PYTHONPATH=`pythonpath`, made from the
    zygote's `current` one, whose PYTHONPATH added `pythonpath_count` entries: the working
    directory first, then PYTHONPATH's entries, then the rest (standard library, site-packages)."""
    return [cwd, *pythonpath_entries(pythonpath, cwd), *current[1 + pythonpath_count :]]


def exit_code_of(exc: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught SystemExit (printing a non-int code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}) failed: {os.strerror(err)}")


def _ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[1])


_HELD = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _noop(signum: int, frame: types.FrameType | None) -> None:
    return None


class Zygote:
    """The zygote's loop: serve requests on `sock`, reap children, report their exits."""

    def __init__(self, sock: socket.socket, grace: float) -> None:
        self.sock = sock
        self.grace = grace
        self.pid = os.getpid()
        self.children: dict[int, str] = {}  # pid -> name, until reported
        self.stopping = False
        self.peer_gone = False
        self.unsafe = ""  # why forking is no longer safe (a preloaded module started a thread)
        # How many sys.path entries the zygote's own PYTHONPATH added (a child's replace them).
        self.pythonpath_count = len(pythonpath_entries(os.environ.get("PYTHONPATH"), os.getcwd()))
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        # What a fresh interpreter has; the child gets these back.
        self.default_handlers = {sig: signal.getsignal(sig) for sig in _HELD}

    # -- the loop -----------------------------------------------------------------------------
    def run(self, preload: tuple[str, ...]) -> int:
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _noop)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)
        with imports_without_gc():
            for module in preload:
                self._preload(module)
        self._send(Ready(pid=self.pid))
        sock = self.sock.fileno()
        while not self.stopping:
            readable, _, _ = select.select([sock, self.wake_r], [], [])
            self._drain_wakeups()
            self._reap()
            if sock in readable:
                self._serve_available()
        self._stop_children()
        return 0

    def _on_stop(self, signum: int, frame: types.FrameType | None) -> None:
        self.stopping = True

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass

    def _send(self, report: Report, fds: list[int] | None = None) -> None:
        if self.peer_gone:
            return
        try:
            if fds:
                socket.send_fds(self.sock, [encode(report)], fds)
            else:
                self.sock.send(encode(report))
        except OSError:  # the agent is gone: stop what we started
            self.peer_gone = True
            self.stopping = True

    def _serve_available(self) -> None:
        while not self.stopping:
            try:
                data = self.sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the agent closed its end: time to go
                self.peer_gone = True
                self.stopping = True
                return
            try:
                request = decode_request(data)
            except msgspec.DecodeError as exc:
                print(f"tether zygote: bad request ({exc}); ignored", file=sys.stderr)
                continue
            self._start(request)

    # -- starting a child ---------------------------------------------------------------------
    def _preload(self, module: str) -> None:
        if module in sys.modules:
            return
        try:
            importlib.import_module(module)
        except BaseException as exc:  # even SystemExit: the child imports it itself, and says what is wrong
            print(f"tether zygote: not preloading {module!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        self._check_threads(f"since importing {module!r}")

    def _check_threads(self, since: str) -> None:
        threads = thread_count()
        if threads != 1 and not self.unsafe:
            since = f" {since}" if since else ""
            self.unsafe = f"the zygote runs {threads} threads{since}; a fork of a threaded process is unsafe"
            print(f"tether zygote: {self.unsafe}; forking nothing more", file=sys.stderr)

    def _start(self, req: Start) -> None:
        with imports_without_gc():
            for module in req.preload:
                self._preload(module)
        self._check_threads("")  # before every fork, whatever started them
        if self.unsafe:
            self._send(Refused(id=req.id, reason=self.unsafe))
            return
        # What could fail in the child is tried here, so that a refusal (and the agent's spawn,
        # which raises as it always has) comes instead of a child that exits at once.
        try:
            if not os.path.isdir(req.cwd) or not os.access(req.cwd, os.X_OK):
                raise NotADirectoryError(f"cwd {req.cwd!r} is not a directory this user may enter")
            log = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            self._send(Refused(id=req.id, reason=str(exc)))
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # Held back across the fork: a stop signal for the child before it has the default
        # handlers back would reach the zygote's handler (and be lost); held, it ends the child.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(log)
            self._send(Refused(id=req.id, reason=f"fork failed: {exc}"))
            return
        if pid == 0:  # the child
            self._become(req, log, mask)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(log)
        # Not reaped before this: reaping happens on this thread only, so the pid is still ours.
        pidfd = os.pidfd_open(pid)
        self.children[pid] = req.name
        try:
            self._send(Started(id=req.id, pid=pid), [pidfd])
        finally:
            os.close(pidfd)

    def _become(self, req: Start, log: int, mask: set[int | signal.Signals]) -> NoReturn:
        """In the fresh child: set it up as the spawn would, run the module, exit. Never returns."""
        try:
            os.setsid()  # own session and process group: stopped and killed as a group
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != self.pid:  # the zygote died before the signal was armed
                os._exit(1)
            signal.set_wakeup_fd(-1)
            for sig, handler in self.default_handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self.sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            for key in req.env_unset:
                os.environ.pop(key, None)
            os.environ.update(req.env_set)
            os.chdir(req.cwd)
            sys.path[:] = child_sys_path(
                sys.path, self.pythonpath_count, os.getcwd(), os.environ.get("PYTHONPATH")
            )
            sys.argv = ["-m", *req.args]  # runpy puts the module's file in argv[0], as `python -m`
            with contextlib.suppress(Exception):  # cosmetic: ps shows the command, not the zygote's
                show_as([sys.executable, "-m", req.module, *req.args])
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = sys.modules["builtins"]
            sys.modules["__main__"] = main
        except BaseException as exc:  # checked beforehand; said in its log if it happens anyway
            with contextlib.suppress(BaseException):
                print(
                    f"tether zygote: setting {req.name!r} up failed: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )
            os._exit(127)
        os._exit(_run_module(req.module))

    # -- exits --------------------------------------------------------------------------------
    def _reap(self) -> None:
        reported = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            name = self.children.pop(pid, None)
            if name is None:  # an orphan re-parented to us
                continue
            # What it left in its group dies with it, as after the shim's command.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            self._send(Exited(pid=pid, returncode=os.waitstatus_to_exitcode(status)))
            reported = True
        if reported:
            self._kill_orphans()

    def _kill_orphans(self) -> None:
        """SIGKILL what a child detached and the kernel re-parented to us (we are a subreaper)."""
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in self.children and _ppid_of(int(entry)) == self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)

    def _stop_children(self) -> None:
        """SIGTERM every child, `grace` seconds, SIGKILL each group; report and reap them all."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while self.children and (left := deadline - time.monotonic()) > 0:
            select.select([self.wake_r], [], [], left)  # woken by SIGCHLD
            self._drain_wakeups()
            self._reap()
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        while self.children:
            select.select([self.wake_r], [], [], 0.1)
            self._drain_wakeups()
            self._reap()
        self._kill_orphans()


def _run_module(module: str) -> int:
    """Run `module` as `python -m` does, then end as the interpreter would: the exit status
    (or death by SIGINT after an uncaught KeyboardInterrupt), after joining non-daemon threads
    and running atexit handlers."""
    import atexit
    import runpy
    import threading

    code = 0
    interrupted = False
    # A preloaded copy stays out of the way: `python -m` runs the module as __main__ only.
    sys.modules.pop(module, None)
    try:
        runpy._run_module_as_main(module)  # type: ignore[attr-defined]  # what `python -m` calls
    except SystemExit as exc:
        code = exit_code_of(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter shutdown does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120  # as the interpreter does when flushing stdout fails
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.runtime.process.zygote")
    parser.add_argument("--fd", type=int, required=True, help="This end of the agent's socketpair.")
    parser.add_argument("--parent-pid", type=int, required=True, help="The agent; exit when it is gone.")
    parser.add_argument("--grace", type=float, default=10.0, help="Seconds between SIGTERM and SIGKILL.")
    parser.add_argument("--room", default="", help="Blank: room for a child's command line (see show_as).")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="Import nothing up front (not RUNTIME_PRELOAD): only the requests' preloads.",
    )
    args = parser.parse_args(argv)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != args.parent_pid:  # the agent died before the signal was armed
        print(f"tether zygote: agent {args.parent_pid} is gone", file=sys.stderr)
        return 1
    sock = socket.socket(fileno=args.fd)
    return Zygote(sock, args.grace).run(() if args.bare else RUNTIME_PRELOAD)


if __name__ == "__main__":
    _code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing of the zygote's needs finalising, and tearing down what it preloaded (torch, for the
    # secret-less one) would cost ~0.1 CPU-second at every run's end.
    os._exit(_code)

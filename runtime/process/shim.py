"""`python -m tether.runtime.process.shim --parent-pid P --grace G -- argv...`: keeps a child from
outliving its owner.

The agent starts the shim as the leader of a new session and process group; the shim starts
the command in that same group and waits for it. It makes sure nothing survives:

- PR_SET_PDEATHSIG: when the agent (or the head with its in-process agent) dies, even by
  SIGKILL, the kernel sends the shim SIGTERM; the shim then tears the group down itself.
- SIGTERM/SIGINT/SIGHUP to the shim are forwarded to the group, and after `--grace` seconds
  whatever is left gets SIGKILL.
- PR_SET_CHILD_SUBREAPER: descendants that detach (double fork) are re-parented to the shim,
  which kills them with the group when the command ends.

The shim exits with the command's exit code, or dies by the signal that killed it, so the
agent sees the command's own status.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
import types

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {value}) failed: {os.strerror(err)}")


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Get `signum` when the parent dies (a trainer rank whose torchrun agent was SIGKILLed would
    otherwise live on, orphaned, holding its ports); exit now if it is already gone."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:  # died before the signal was armed
        os.kill(os.getpid(), signum)


def _stat_fields(pid: int) -> tuple[int, int] | None:
    """(ppid, pgrp) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields start after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[2])


def _leftovers(me: int) -> list[int]:
    """Processes in my group or re-parented to me, except me (they must die with the command)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        stat = _stat_fields(int(entry))
        if stat is not None and (stat[1] == me or stat[0] == me):
            found.append(int(entry))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_available() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _clean_up(me: int, wait: float) -> None:
    """SIGTERM what is left, wait up to `wait` seconds, SIGKILL the rest."""
    pids = _leftovers(me)
    if not pids:
        return
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        _reap_available()
        pids = _leftovers(me)
        if not pids:
            return
        time.sleep(0.02)  # polling /proc: these processes are not our direct children
    _signal_all(_leftovers(me), signal.SIGKILL)
    _reap_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.runtime.process.shim")
    parser.add_argument("--parent-pid", type=int, required=True, help="The owner; exit when it is gone.")
    parser.add_argument("--grace", type=float, default=10.0, help="Seconds between SIGTERM and SIGKILL.")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments.")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")

    me = os.getpid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != args.parent_pid:  # the owner died before PDEATHSIG was armed
        print(f"tether shim: owner {args.parent_pid} is gone; not starting {command[0]}", file=sys.stderr)
        return 1

    terminating = False

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        _signal_all(_leftovers(me), signal.SIGKILL)

    def on_term(signum: int, frame: types.FrameType | None) -> None:
        nonlocal terminating
        if terminating:
            return
        terminating = True
        _signal_all(_leftovers(me), signal.SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, max(args.grace, 0.001))

    signal.signal(signal.SIGALRM, on_alarm)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_term)

    try:
        child = subprocess.Popen(command, close_fds=True)
    except OSError as exc:
        print(f"tether shim: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127

    status = 0
    while True:
        pid, status = os.waitpid(-1, 0)  # also reaps re-parented orphans (we are a subreaper)
        if pid == child.pid:
            break
    child.returncode = 0  # reaped here; keep Popen from waiting on it again
    signal.setitimer(signal.ITIMER_REAL, 0)
    _clean_up(me, wait=min(max(args.grace, 0.0), 2.0))

    if os.WIFSIGNALED(status):
        died_by = os.WTERMSIG(status)
        sys.stdout.flush()
        sys.stderr.flush()
        if died_by not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(died_by, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [died_by])
        os.kill(me, died_by)  # die the way the command died, so the owner sees its status
        return 128 + died_by
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    raise SystemExit(main())

"""bin/systemd/tether@.service and the head's side of the sd_notify protocol.

The unit is read with configparser (and checked by `systemd-analyze verify` where installed).
The protocol is checked against a test AF_UNIX datagram socket standing in for systemd: a real
`tether run` sends READY=1, a STATUS= line per step, WATCHDOG=1 every WATCHDOG_USEC/2 and
STOPPING=1; a head stopped with SIGSTOP sends no ping for the stall, so a systemd watchdog of
WatchdogSec would have reported it. The watchdog loop itself is also checked in-process with a
blocked event loop.
"""

from __future__ import annotations

import asyncio
import configparser
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_support import Workspace, jsonl, make_workspace
from test_ops_slurm import free_port_block

from tether.runtime.sdnotify import Notifier

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "bin" / "systemd" / "tether@.service"


def read_unit(path: Path) -> configparser.ConfigParser:
    # strict: a key given twice in one section is an error here (systemd would merge or override).
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def seconds(value: str) -> float:
    """A systemd time span such as `300`, `90s`, `15min` or `1h` in seconds."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "ms": 1e-3}
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(number) * units[value[len(number) :]]


def test_unit_file_has_the_service_contract() -> None:
    unit = read_unit(UNIT)
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] in ("main", "all")
    assert seconds(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert seconds(service["RestartSec"]) > 0
    assert service["KillMode"] == "mixed"  # SIGTERM to the head only; it stops its own children
    assert seconds(service["TimeoutStopSec"]) >= 300  # room for a checkpoint
    exec_start = service["ExecStart"].split()
    assert exec_start[1:3] == ["run", "--config"] and exec_start[3] == "/etc/tether/%i.yaml"
    assert "--auto-resume" in exec_start and "--save" in exec_start
    assert service["WorkingDirectory"]
    assert service["EnvironmentFile"].startswith("-/etc/tether/%i")
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # The launcher path is the installed one; point it at this checkout's so verify can check it.
    text = UNIT.read_text().replace("/opt/tether/bin/tether", str(REPO / "bin" / "tether"))
    unit = tmp_path / "tether@demo.service"
    unit.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


# -- the notify protocol against a test socket ----------------------------------------------
@dataclass
class NotifySocket:
    """A stand-in for systemd's notify socket: records (arrival time, message) of every datagram."""

    path: Path
    messages: list[tuple[float, str]] = field(default_factory=list)
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> NotifySocket:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._receive, name="notify-socket", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        assert self._thread is not None and self._sock is not None
        self._thread.join(timeout=5)
        self._sock.close()

    def _receive(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, message: str) -> list[float]:
        return [t for t, m in list(self.messages) if message in m.split("\n")]

    def wait_for(self, predicate: object, deadline: float, proc: subprocess.Popen[str]) -> None:
        assert callable(predicate)
        while not predicate():
            assert proc.poll() is None, (
                f"tether run exited {proc.returncode} early:\n{proc.communicate()[0][-4000:]}"
            )
            assert time.monotonic() < deadline, f"timed out; got {self.messages[-10:]}"
            time.sleep(0.05)


def watchdog_reports(
    pings: list[float], start: float, end: float, watchdog_s: float
) -> list[tuple[float, float]]:
    """What systemd's watchdog would report: every span of `watchdog_s` or more without a ping."""
    marks = [start, *[p for p in pings if start <= p <= end], end]
    return [(a, b) for a, b in itertools.pairwise(marks) if b - a >= watchdog_s]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return make_workspace(tmp_path_factory.mktemp("systemd"))


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    with NotifySocket(tmp_path / "notify.sock") as sock:
        yield sock


@pytest.mark.slow
def test_tether_run_speaks_sd_notify_and_a_stall_stops_the_pings(
    ws: Workspace, notify_socket: NotifySocket, tmp_path: Path
) -> None:
    watchdog_s = 0.6  # pings every 0.3 s
    stall_s = 1.5  # under the heartbeat timeout (3 s), so the run survives the stall
    steps = 60  # a loop that lasts a few seconds: pings before, during and after the stall
    run = tmp_path / "run"
    first = free_port_block()  # other runs on this machine use the default range
    ports = ["--node-port-first", str(first), "--node-port-last", str(first + 99)]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NOTIFY_SOCKET": str(notify_socket.path),
        "WATCHDOG_USEC": str(int(watchdog_s * 1e6)),
    }
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether", "run", *ws.flags(run, "--num-rollout", str(steps), *ports)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        notify_socket.wait_for(lambda: len(notify_socket.times("WATCHDOG=1")) >= 3, deadline, proc)
        stopped = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)  # the head hangs: its event loop runs nothing
        time.sleep(stall_s)  # the stall being measured, not a wait for an event
        resumed = time.monotonic()
        os.kill(proc.pid, signal.SIGCONT)
        notify_socket.wait_for(
            lambda: len([p for p in notify_socket.times("WATCHDOG=1") if p > resumed]) >= 2, deadline, proc
        )
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]

    messages = [m for _, m in notify_socket.messages]
    ready = [m for m in messages if m.startswith("READY=1")]
    assert len(ready) == 1 and "STATUS=running from step 0" in ready[0]
    statuses = [m for m in messages if m.startswith("STATUS=")]
    assert statuses == [f"STATUS=step {k}/{steps} version {k}" for k in range(1, steps + 1)]
    assert messages[-1] == "STOPPING=1"
    assert messages.index(ready[0]) < messages.index("WATCHDOG=1") < messages.index("STOPPING=1")

    pings = notify_socket.times("WATCHDOG=1")
    ready_at = notify_socket.times("READY=1")[0]
    assert len([p for p in pings if p < stopped]) >= 3
    # Nothing while stopped (a ping already in flight when SIGSTOP landed may be read just after).
    assert not [p for p in pings if stopped + 0.2 < p <= resumed]
    # The wakeup that comes late after the stall is skipped, so the next ping is a fresh half period on.
    after = [p for p in pings if p > resumed]
    assert len(after) >= 2 and after[0] - resumed >= watchdog_s / 2 - 0.02
    # systemd with WatchdogSec=0.6 would have reported the stall (and only on its span).
    reports = watchdog_reports(pings, ready_at, pings[-1], watchdog_s)
    assert any(a <= stopped + 0.2 and b >= resumed for a, b in reports), reports
    # The run itself went on to the end.
    assert [m["step"] for m in jsonl(run / "metrics.jsonl") if m.get("step", -1) >= 0] == list(range(steps))


def test_watchdog_loop_skips_the_ping_after_a_blocked_event_loop(notify_socket: NotifySocket) -> None:
    period = 0.2  # WATCHDOG_USEC = 200 ms: pings every 100 ms

    class Recording(Notifier):
        def __init__(self) -> None:
            super().__init__(str(notify_socket.path), int(period * 1e6))
            self.sent: list[float] = []
            self.pinged = asyncio.Event()

        def watchdog(self) -> bool:
            self.sent.append(time.monotonic())
            self.pinged.set()
            return super().watchdog()

        async def until(self, count: int, after: float = 0.0) -> None:
            while len([t for t in self.sent if t > after]) < count:
                self.pinged.clear()
                await self.pinged.wait()

    notifier = Recording()

    async def main() -> tuple[float, float, float]:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(notifier.watchdog_loop())
            await notifier.until(3)
            blocked = time.monotonic()
            time.sleep(3 * period)  # noqa: ASYNC251  # the point: a loop that does not run
            unblocked = time.monotonic()
            await notifier.until(2, after=unblocked)
            task.cancel()
        return blocked, unblocked, time.monotonic()

    blocked, unblocked, _ = asyncio.run(main())
    notifier.close()
    assert not [t for t in notifier.sent if blocked < t < unblocked]
    # The timer that fired late (3 periods) is not a ping: the next comes half a period later.
    first_after = min(t for t in notifier.sent if t > unblocked)
    assert first_after - unblocked >= period / 2 - 0.01
    deadline = time.monotonic() + 5
    while len(notify_socket.times("WATCHDOG=1")) < len(notifier.sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(notify_socket.times("WATCHDOG=1")) == len(notifier.sent)


def test_watchdog_is_off_for_another_pid_and_without_a_socket(tmp_path: Path) -> None:
    sock = str(tmp_path / "x.sock")
    env = {"NOTIFY_SOCKET": sock, "WATCHDOG_USEC": "1000000"}
    mine = Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())})
    other = Notifier.from_env({**env, "WATCHDOG_PID": "1"})
    mine.close()
    other.close()
    assert mine.watchdog_usec == 1_000_000 and other.watchdog_usec is None
    silent = Notifier.from_env({})
    assert not silent.enabled and not silent.ready() and not silent.watchdog()
    with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
        Notifier.from_env({"NOTIFY_SOCKET": "relative/path"})

"""bin/systemd/tether@.service read with configparser, and the head's sd_notify watchdog loop
in-process: a blocked event loop sends no ping for the stall (a real `tether run` speaking the
protocol, and `systemd-analyze verify`: tests/integration/test_ops_systemd.py)."""

from __future__ import annotations

import asyncio
import configparser
import os
import time
from pathlib import Path

import pytest
from support import REPO
from support.sdnotify import NotifySocket

from tether.runtime.process.sdnotify import Notifier

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

"""bin/systemd/tether@.service and the head's side of the sd_notify protocol, with processes.

The unit is checked by `systemd-analyze verify` where installed. The protocol is checked against
a test AF_UNIX datagram socket standing in for systemd (support.sdnotify.NotifySocket): a real
`tether run` sends READY=1, a STATUS= line per step, WATCHDOG=1 every WATCHDOG_USEC/2 and
STOPPING=1; a head stopped with SIGSTOP sends no ping for the stall, so a systemd watchdog of
WatchdogSec would have reported it. The unit's contract as read with configparser, and the
watchdog loop in-process with a blocked event loop, are tests/unit/test_ops_systemd_unit_and_watchdog.py.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO
from support.e2e import Workspace, jsonl
from support.net import free_port_block
from support.sdnotify import NotifySocket

UNIT = REPO / "bin" / "systemd" / "tether@.service"


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


def watchdog_reports(
    pings: list[float], start: float, end: float, watchdog_s: float
) -> list[tuple[float, float]]:
    """What systemd's watchdog would report: every span of `watchdog_s` or more without a ping."""
    marks = [start, *[p for p in pings if start <= p <= end], end]
    return [(a, b) for a, b in itertools.pairwise(marks) if b - a >= watchdog_s]


def test_tether_run_speaks_sd_notify_and_a_stall_stops_the_pings(
    ws: Workspace, notify_socket: NotifySocket, run_dir: Path
) -> None:
    watchdog_s = 0.6  # pings every 0.3 s
    stall_s = 1.5  # under the heartbeat timeout (3 s), so the run survives the stall
    steps = 60  # a loop that lasts a few seconds: pings before, during and after the stall
    run = run_dir
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

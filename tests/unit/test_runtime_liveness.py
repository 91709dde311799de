"""Liveness monitor (manual clock), signal handling and sd_notify, all in one process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import pytest

from tether.runtime.errors import HeartbeatLost
from tether.runtime.loop import run
from tether.runtime.process.sdnotify import Notifier
from tether.runtime.process.signals import StopRequested, handle_signals
from tether.runtime.rpc.liveness import LivenessMonitor, ManualClock


def test_hung_probe_is_reported_after_timeout() -> None:
    async def main() -> None:
        clock = ManualClock()
        answers = 0
        hang = asyncio.Event()

        async def probe() -> None:
            nonlocal answers
            answers += 1
            if answers >= 3:
                await asyncio.Event().wait()  # the peer stops answering

        reports: list[HeartbeatLost] = []
        mon = LivenessMonitor(
            probe,
            interval=1.0,
            timeout=2.0,
            first_wait=5.0,
            clock=clock,
            name="peer",
            on_failure=reports.append,
        )
        task = asyncio.ensure_future(mon.run())  # awaited below
        await clock.wait_for_sleepers(1)
        clock.advance(4.9)
        assert answers == 0  # nothing before first_wait
        clock.advance(0.1)
        for expected in (1, 2):
            await clock.wait_for_sleepers(1)
            while mon.probes < expected:  # noqa: ASYNC110  # one loop turn for the probe task
                await asyncio.sleep(0)  # let the probe task finish its step
            clock.advance(1.0)
        await clock.wait_for_sleepers(1)  # the timeout timer of the hung third probe
        while answers < 3:  # noqa: ASYNC110  # one loop turn for the probe task
            await asyncio.sleep(0)
        clock.advance(1.9)
        await asyncio.sleep(0)
        assert not task.done()
        clock.advance(0.1)
        with pytest.raises(HeartbeatLost, match="peer: heartbeat lost \\(no answer within 2 s; 1 heartbeat"):
            await task
        assert len(reports) == 1 and mon.probes == 2
        hang.set()

    run(main())


def test_failing_probe_is_reported_at_once() -> None:
    async def main() -> None:
        clock = ManualClock()

        async def probe() -> None:
            raise ConnectionError("refused")

        mon = LivenessMonitor(probe, interval=1.0, timeout=2.0, first_wait=0.0, clock=clock, name="agent")
        with pytest.raises(HeartbeatLost, match="probe failed: ConnectionError: refused"):
            await mon.run()
        with pytest.raises(ValueError, match="interval=0"):
            LivenessMonitor(probe, interval=0, timeout=1, first_wait=0)

    run(main())


def test_a_peer_is_lost_only_after_misses_in_a_row() -> None:
    """One late answer (a peer's event loop stalled for a moment) is tolerated; a good answer
    resets the count; `misses` failures in a row end it, saying how long there was no answer."""

    async def main() -> None:
        clock = ManualClock()
        script = iter([True, False, True, False, False, True, False, False, False])

        async def probe() -> None:
            if not next(script):
                raise ConnectionError("no answer")

        mon = LivenessMonitor(
            probe, interval=1.0, timeout=0.5, first_wait=0.0, misses=3, clock=clock, name="head"
        )
        task = asyncio.ensure_future(mon.run())
        for _ in range(8):  # probes 1..8 run with the clock at 0..7
            await clock.wait_for_sleepers(1)
            assert not task.done()
            clock.advance(1.0)
        with pytest.raises(HeartbeatLost, match=r"3 heartbeat\(s\) in a row missed, no answer for [23]\.0 s"):
            await task  # probe 9 (time 8) is the third miss in a row; the last answer was at 5
        assert mon.probes == 3 and mon.missed == 3
        with pytest.raises(ValueError, match="misses=0"):
            LivenessMonitor(probe, interval=1, timeout=1, first_wait=0, misses=0)

    run(main())


def test_sigusr1_checkpoints_and_sigterm_checkpoints_then_stops() -> None:
    async def main() -> None:
        done: list[str] = []
        ran = asyncio.Event()

        async def checkpoint() -> None:
            done.append("ckpt")
            ran.set()

        async with handle_signals(checkpoint) as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            async with asyncio.timeout(5):
                await ran.wait()
            assert not stop.is_set() and done == ["ckpt"]
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(StopRequested, match="SIGTERM"):
                async with asyncio.timeout(5):
                    await stop.raise_when_requested()
            assert done == ["ckpt", "ckpt"] and stop.checkpoints == 2

    run(main())


def test_sd_notify_messages_reach_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(5)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
        assert notifier.watchdog_usec == 100_000
        assert notifier.ready()
        assert notifier.status("step 3/10\nok")
        assert notifier.stopping()
        got = [listener.recv(4096).decode() for _ in range(3)]
        assert got == ["READY=1", "STATUS=step 3/10 ok", "STOPPING=1"]

        async def watch() -> None:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(notifier.watchdog_loop())
                loop = asyncio.get_running_loop()
                listener.setblocking(False)
                for _ in range(2):
                    assert (await loop.sock_recv(listener, 4096)) == b"WATCHDOG=1"
                task.cancel()

        run(watch())
        notifier.close()
    assert not Notifier.from_env({}).ready()  # not under systemd: a no-op
    with pytest.raises(ValueError, match="NOTIFY_SOCKET='relative'"):
        Notifier.from_env({"NOTIFY_SOCKET": "relative"})

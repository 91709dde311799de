"""One liveness monitor for everything that must keep answering: actors, agents, engines.

    monitor = LivenessMonitor(handle.ping, interval=1.0, timeout=2.0, first_wait=0.5, name="agent node1")
    tg.create_task(monitor.run())   # raises HeartbeatLost when the probe fails or hangs

A hung peer is reported at most `interval + timeout` after its last good answer. The clock
is injectable so that tests drive time by hand (`ManualClock`) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Protocol

from tether.runtime.errors import HeartbeatLost


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """The event loop's monotonic clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only when `advance` is called (for tests of timeouts)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._changed = asyncio.Event()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        self._changed.set()
        await fut

    @property
    def sleepers(self) -> int:
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    async def wait_for_sleepers(self, count: int) -> None:
        """Wait until at least `count` tasks are asleep on this clock."""
        while self.sleepers < count:
            self._changed.clear()
            await self._changed.wait()

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)


class LivenessMonitor:
    """Probes a peer every `interval` seconds, the first time after `first_wait`.

    `run()` returns never on success and raises `HeartbeatLost` once `misses` probes in a row
    raised or did not finish within `timeout` (one late answer from a peer whose event loop
    stalled for a moment is not a lost peer); `on_failure`, when given, is called first.
    """

    def __init__(
        self,
        probe: Callable[[], Awaitable[None]],
        *,
        interval: float,
        timeout: float,
        first_wait: float,
        name: str = "peer",
        misses: int = 1,
        on_failure: Callable[[HeartbeatLost], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if misses < 1:
            raise ValueError(f"misses={misses!r}: must be at least 1")
        for key, value in (("interval", interval), ("timeout", timeout), ("first_wait", first_wait)):
            if not value >= 0 or (key != "first_wait" and value == 0):
                raise ValueError(f"{key}={value!r}: must be a positive number of seconds")
        self.probe = probe
        self.interval = interval
        self.timeout = timeout
        self.first_wait = first_wait
        self.name = name
        self.misses = misses
        self.missed = 0  # consecutive failed probes so far
        self.on_failure = on_failure
        self.clock: Clock = clock or LoopClock()
        self.last_ok: float | None = None
        self.probes = 0

    async def _probe_once(self) -> None:
        """One probe raced against the clock; raises HeartbeatLost on failure."""
        probe = asyncio.ensure_future(self.probe())
        timer = asyncio.ensure_future(self.clock.sleep(self.timeout))
        try:
            await asyncio.wait((probe, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (probe, timer):
                if not task.done():
                    task.cancel()
            for task in (probe, timer):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if not probe.done() or probe.cancelled():
            raise HeartbeatLost(self.name, f"no answer within {self.timeout:g} s")
        exc = probe.exception()
        if exc is not None:
            raise HeartbeatLost(self.name, f"probe failed: {type(exc).__name__}: {exc}") from exc

    async def run(self) -> None:
        since = self.clock.now()  # the last time the peer was known alive
        await self.clock.sleep(self.first_wait)
        while True:
            started = self.clock.now()
            try:
                await self._probe_once()
            except HeartbeatLost as missed:
                self.missed += 1
                if self.missed >= self.misses:
                    waited = self.clock.now() - (self.last_ok if self.last_ok is not None else since)
                    lost = HeartbeatLost(
                        self.name,
                        f"{missed.reason}; {self.missed} heartbeat(s) in a row missed, "
                        f"no answer for {waited:.1f} s",
                    )
                    if self.on_failure is not None:
                        self.on_failure(lost)
                    raise lost from missed
            else:
                self.missed = 0
                self.probes += 1
                self.last_ok = self.clock.now()
            await self.clock.sleep(max(0.0, started + self.interval - self.clock.now()))

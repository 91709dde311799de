"""SIGTERM/SIGINT/SIGUSR1 for a long-running head: checkpoint first, then stop.

    async with handle_signals(checkpoint) as stop:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(stop.raise_when_requested())   # ends the group with StopRequested
            tg.create_task(train_loop())

SIGUSR1 (what SLURM sends ahead of preemption with `--signal=USR1@...`) runs `checkpoint`
and carries on. SIGTERM and SIGINT run `checkpoint`, then set the stop request. A second
SIGTERM/SIGINT while the checkpoint runs sets the stop request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """Raised by `StopRequest.raise_when_requested` once a stop signal was handled."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stop requested by {signal.Signals(signum).name}")


class StopRequest:
    """What `handle_signals` yields: whether (and by which signal) a stop was requested."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signum: int | None = None
        self.checkpoints = 0

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> int:
        await self.event.wait()
        assert self.signum is not None
        return self.signum

    async def raise_when_requested(self) -> None:
        raise StopRequested(await self.wait())

    def _set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()


@contextlib.asynccontextmanager
async def handle_signals(
    checkpoint: Callable[[], Awaitable[None]],
    *,
    stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
    checkpoint_signals: tuple[int, ...] = (signal.SIGUSR1,),
) -> AsyncIterator[StopRequest]:
    """Install the handlers on the running loop for the duration of the block."""
    loop = asyncio.get_running_loop()
    request = StopRequest()
    queue: asyncio.Queue[int] = asyncio.Queue()

    def on_signal(signum: int) -> None:
        if signum in stop_signals and request.signum is not None and not request.is_set():
            request._set(signum)  # second stop signal during the checkpoint: stop now
        queue.put_nowait(signum)

    async def worker() -> None:
        while True:
            signum = await queue.get()
            if signum in stop_signals and request.is_set():
                continue
            if signum in stop_signals:
                request.signum = signum
            log.warning("received %s: checkpointing", signal.Signals(signum).name)
            try:
                await checkpoint()
                request.checkpoints += 1
            except Exception:
                log.exception("checkpoint hook failed on %s", signal.Signals(signum).name)
            if signum in stop_signals:
                request._set(signum)

    installed = []
    try:
        for signum in (*stop_signals, *checkpoint_signals):
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
        task = asyncio.create_task(worker(), name="signal-worker")
        try:
            yield request
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)

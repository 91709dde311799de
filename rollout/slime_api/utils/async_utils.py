"""`slime.utils.async_utils`: run a coroutine to completion from synchronous code.

slime runs its rollout functions synchronously and hands coroutines to a background event loop
with `run(coro)`. On tether the rollout's event loop is the head's: a synchronous rollout
function runs in a worker thread (see `tether.rollout.slime_api.bridge`), and `run` schedules the
coroutine on the loop the rollout context was entered on and waits for it, so the coroutine
reaches the same router, sessions and context as every other hook. Outside a rollout (a script,
a test) `run` uses a fresh loop of its own for the one call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from tether.rollout.rollout_fn import RolloutContext, current_context

__all__ = ["get_async_loop", "run"]

T = TypeVar("T")


def _context() -> RolloutContext | None:
    try:
        return current_context()
    except RuntimeError:
        return None


class AsyncLoop:
    """The loop `run` uses (slime's `get_async_loop()` object): `.loop` and `.run(coro)`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError(
                "run() waits for the coroutine, so it cannot be called on the rollout's own event loop; "
                "`await` the coroutine there (tether runs synchronous rollout functions in a thread, "
                "where run() works)"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def get_async_loop() -> AsyncLoop:
    """The rollout's event loop (the head's); only inside a rollout, where tether installs it."""
    ctx = _context()
    if ctx is None or ctx.loop is None:
        raise RuntimeError(
            "get_async_loop() is only available inside a rollout (no rollout context is installed)"
        )
    return AsyncLoop(ctx.loop)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the rollout's event loop and return its result (see the module docstring)."""
    ctx = _context()
    if ctx is not None and ctx.loop is not None:
        return AsyncLoop(ctx.loop).run(coro)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "run() was called on a running event loop outside a rollout; `await` the coroutine instead"
    )

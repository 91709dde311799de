"""Waiting for a condition that has no event to wait on, under a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], within: float, what: str) -> None:
    """Wait for `condition` (checked every 10 ms: the counters it reads have no event) or fail
    naming `what`."""
    try:
        async with asyncio.timeout(within):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}") from None

"""Server-sent events for streamed generation, as SGLang sends them (`data: ...`, then `[DONE]`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from aiohttp import web


async def send_events(
    request: web.Request, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]
) -> web.StreamResponse:
    """Stream each encoded event, then `data: [DONE]`; a client gone mid-stream calls
    `on_disconnect` (abort its requests) before the error propagates."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for event in events:
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionError, asyncio.CancelledError):
        on_disconnect()
        raise
    await resp.write_eof()
    return resp

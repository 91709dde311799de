"""A stand-in for slime's rollout buffer (slime_plugins/rollout_buffer/buffer.py): aiohttp on
127.0.0.1, in the test's process, answering /get_rollout_data from a script; and trajectories in
the shape its generators write them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from aiohttp import web

Answer = dict[str, Any] | int
"""What the stand-in answers one /get_rollout_data with: a JSON body, or an HTTP error status."""


def trajectory(instance: int, k: int, *, reward: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {
        "uid": f"u{instance}-{k}",
        "instance_id": instance,
        "messages": [
            {"role": "user", "content": f"q{instance}"},
            {"role": "assistant", "content": f"a{k}"},
        ],
        "reward": reward,
        "extra_info": {"finish_reason": "stop", **extra},
    }


def group(instance: int, n: int = 2, **extra: Any) -> list[dict[str, Any]]:
    return [trajectory(instance, k, **extra) for k in range(n)]


def ready(*trajectories: dict[str, Any], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"success": True, "message": "", "data": {"data": list(trajectories), "meta_info": meta or {}}}


NOT_READY: dict[str, Any] = {"success": False, "message": "No data available to read", "data": None}


class StandIn:
    """A rollout buffer that answers from a script: one entry per /get_rollout_data call (the last
    repeats), and records what /start_rollout received."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = list(answers)
        self.starts: list[dict[str, Any]] = []
        self.fetches = 0
        self.url = ""

    async def start(self, request: web.Request) -> web.Response:
        self.starts.append(await request.json())
        return web.json_response({"message": "Rollout started"})

    async def fetch(self, request: web.Request) -> web.Response:
        assert await request.json() == {}
        self.fetches += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, int):
            return web.Response(status=answer, text="buffer broke")
        return web.json_response(answer)


@asynccontextmanager
async def serving(stand_in: StandIn) -> AsyncIterator[StandIn]:
    app = web.Application()
    app.router.add_post("/start_rollout", stand_in.start)
    app.router.add_post("/get_rollout_data", stand_in.fetch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    stand_in.url = f"http://127.0.0.1:{port}"
    try:
        yield stand_in
    finally:
        await runner.cleanup()


@contextmanager
def serving_in_thread(stand_in: StandIn) -> Iterator[StandIn]:
    """`serving` on an event loop of its own in a thread: for callers that block their own loop
    (slime's rollout_buffer_example.py posts with `requests` and sleeps with `time.sleep` inside
    its coroutine)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rollout-buffer-stand-in", daemon=True)
    thread.start()
    served = serving(stand_in)
    try:
        asyncio.run_coroutine_threadsafe(served.__aenter__(), loop).result(10)
        try:
            yield stand_in
        finally:
            asyncio.run_coroutine_threadsafe(served.__aexit__(None, None, None), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

"""The router front hooks post to (`args.sglang_router_ip`/`_port`): what it forwards, adds, refuses.

A stand-in router records what reaches the engines; the front is the real aiohttp server on
127.0.0.1, and slime's `post`/`get` (tether.rollout.slime_api.utils.http_utils) are the clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from tether.rollout.routing.front import RouterFront
from tether.rollout.slime_api.utils.http_utils import HTTPStatusError, get, post


class _Engine:
    name = "engine0"

    def __init__(self, calls: list[tuple[str, str, Any]]) -> None:
        self.calls = calls

    async def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        self.calls.append((method, path, body))
        if path == "/generate":
            return {"text": "hi", "output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}
        return {"model_path": "tiny"}


class _Router:
    """What the front uses of tether's Router: call, broadcast, abort_all, engines."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.keys: list[str | None] = []
        self.aborted_all = 0
        self.engines = [_Engine(self.calls)]

    async def call(self, key: str | None, fn: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        self.keys.append(key)
        return await fn(self.engines[0])

    async def broadcast(self, fn: Callable[[Any], Coroutine[Any, Any, Any]]) -> dict[str, Any]:
        return {e.name: await fn(e) for e in self.engines}

    async def abort_all(self) -> None:
        self.aborted_all += 1


def test_front_forwards_what_hooks_call_and_refuses_the_rest() -> None:
    router = _Router()

    async def scenario() -> None:
        stop = asyncio.Event()
        async with RouterFront(router) as front:  # type: ignore[arg-type]
            front.abort_when(stop)
            assert front.host == "127.0.0.1" and front.port > 0
            payload = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            out = await post(f"{front.url}/generate", payload, headers={"X-SMG-Routing-Key": "session-1"})
            assert out["output_ids"] == [7]
            method, path, body = router.calls[-1]
            assert (method, path) == ("POST", "/generate") and body["input_ids"] == [1, 2] and body["rid"]
            assert router.keys[-1] == "session-1"
            assert await get(f"{front.url}/health") == {}
            assert await get(f"{front.url}/get_model_info") == {"model_path": "tiny"}
            await post(f"{front.url}/abort_request", {"abort_all": True})
            assert router.aborted_all == 1
            await post(f"{front.url}/abort_request", {"rid": "r1"})
            assert router.calls[-1] == ("POST", "/abort_request", {"rid": "r1"})
            with pytest.raises(
                HTTPStatusError, match=r"HTTP 404.*update_weights_from_disk is not forwarded"
            ) as err:
                await post(f"{front.url}/update_weights_from_disk", {"model_path": "/x"}, max_retries=1)
            assert err.value.status == 404 and "POST /generate" in err.value.body
            with pytest.raises(HTTPStatusError, match="HTTP 400"):
                await post(f"{front.url}/generate", [1, 2])
            stop.set()  # the rollout is aborting its surplus: no new generation reaches an engine
            sent = len(router.calls)
            out = await post(f"{front.url}/generate", payload)
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(router.calls) == sent
            url = front.url
        with pytest.raises(Exception, match=r"Cannot connect|Connect call failed"):
            await post(f"{url}/generate", payload, max_retries=1)

    asyncio.run(scenario())

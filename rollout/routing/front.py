"""An HTTP front for hooks: SGLang's endpoints at one address, routed to tether's engines.

Hooks written for slime post to `http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`,
an sglang-router in slime. tether's engines require the run's engine key, which hooks must never
hold; so the head serves this front (aiohttp, on 127.0.0.1 by default, a free port) and forwards
what hooks call to an engine chosen by tether's `Router`, adding the key itself. With
--use-sglang-router requests go through the sglang-router, and aborts to each engine directly.

Served: `POST /generate` (to one engine, by the `X-SMG-Routing-Key` header when the policy
hashes), `POST /abort_request` (to every engine), `GET /health`, `GET /health_generate`,
`GET /get_model_info`, `GET /get_server_info`, and the engines' OpenAI-compatible `/v1/*`
endpoints (openai_proxy.py: agents' OpenAI clients, streams included). Anything else (weight updates, memory and engine
control, worker lists) is refused with 404 naming what is served. While the rollout is aborting
its surplus (the context's stop event), `/generate` answers at once with SGLang's abort result.

The front lives as long as its owner's `async with`; leaving it stops serving within
`shutdown_timeout` seconds, requests in flight included. It answers only connections from the
run's own user (the kernel's socket table says whose socket connects): hooks hold no key, and
other users of the machine must not generate through the run's engines.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from tether.rollout.engine_api.client import (
    ROUTING_KEY_HEADER,
    EngineClient,
    EngineError,
    EngineUnavailable,
    new_request_id,
)
from tether.rollout.routing.openai_proxy import SERVED as OPENAI_SERVED
from tether.rollout.routing.openai_proxy import add_openai_routes
from tether.rollout.routing.router import NoEngineError, Router
from tether.runtime.rpc.peer_uid import same_user

log = logging.getLogger(__name__)

SERVED = (
    "POST /generate",
    "POST /abort_request",
    "GET /health",
    "GET /health_generate",
    "GET /get_model_info",
    "GET /get_server_info",
    *OPENAI_SERVED,
)
MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)


def aborted_result(rid: str) -> dict[str, Any]:
    """What SGLang answers for a request aborted before it produced a token."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "abort", "message": "the rollout is aborting its surplus requests"},
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "output_token_logprobs": [],
        },
    }


@web.middleware
async def _same_user_only(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """403 for a connection whose socket belongs to another user (or to no socket the kernel lists)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    local = transport.get_extra_info("sockname") if transport is not None else None
    if peer is None or local is None:
        return _error(403, "tether's router front answers TCP connections of the run's user only")
    if not await asyncio.to_thread(same_user, peer, local, os.getuid()):
        return _error(403, f"tether's router front answers the run's user (uid {os.getuid()}) only")
    return await handler(request)


class RouterFront:
    """See the module docstring. `async with RouterFront(router) as front:` serves at `front.url`."""

    def __init__(
        self,
        router: Router,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 5.0,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self.router = router
        self.host = host
        self.port = port
        self._shutdown_timeout = shutdown_timeout
        self._max_request_bytes = max_request_bytes
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def abort_when(self, event: asyncio.Event) -> None:
        """While `event` is set, /generate answers with an abort at once (the rollout's stop event)."""
        self._stopping = event

    async def __aenter__(self) -> RouterFront:
        app = web.Application(client_max_size=self._max_request_bytes, middlewares=[_same_user_only])
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", self._health)
        for path in ("/health_generate", "/get_model_info", "/get_server_info"):
            app.router.add_get(path, self._forward_get)
        add_openai_routes(app.router, self.router)
        app.router.add_route("*", "/{tail:.*}", self._refuse)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=self._shutdown_timeout
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("router front for hooks at %s", self.url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            async with asyncio.timeout(self._shutdown_timeout + 1.0):
                await runner.cleanup()
        except TimeoutError:
            log.warning("router front at %s took over %.0f s to stop", self.url, self._shutdown_timeout)

    # ----- handlers -----
    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw) if raw else {}
        except msgspec.DecodeError as exc:
            return _error(400, f"{request.path}: the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, f"{request.path}: the body must be a JSON object, not {type(body).__name__}")
        return body

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if body.get("stream"):
            return _error(400, "/generate: stream=true is not served by tether's router front")
        rid = body.setdefault("rid", new_request_id())
        if self._stopping is not None and self._stopping.is_set():
            return _json(aborted_result(str(rid)))
        key = request.headers.get(ROUTING_KEY_HEADER)

        async def send(client: EngineClient) -> Any:
            return await client.request("POST", "/generate", body, retry="connect")

        return await self._answer("/generate", self.router.call(key, send))

    async def _abort(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if body.get("abort_all"):
            await self.router.abort_all()
            return _json({})

        async def abort(client: EngineClient) -> None:
            try:
                await client.request("POST", "/abort_request", body)
            except EngineUnavailable as exc:  # as Router.abort_all: a dead engine's requests fail anyway
                log.warning("abort skipped: %s", exc)

        return await self._answer("/abort_request", self.router.broadcast(abort), empty=True)

    async def _health(self, request: web.Request) -> web.Response:
        if not self.router.engines:
            return _error(503, "no engine is routed (all may be restarting)")
        return _json({})

    async def _forward_get(self, request: web.Request) -> web.Response:
        path = request.path

        async def get(client: EngineClient) -> Any:
            return await client.request("GET", path, retry="always")

        return await self._answer(path, self.router.call(None, get))

    async def _refuse(self, request: web.Request) -> web.Response:
        return _error(
            404,
            f"{request.method} {request.path} is not forwarded by tether's router front; it serves "
            f"{', '.join(SERVED)} (weight updates and engine control stay with tether)",
        )

    async def _answer(self, path: str, call: Awaitable[Any], *, empty: bool = False) -> web.Response:
        try:
            result = await call
        except EngineError as exc:
            return _error(exc.status, f"{path}: engine {exc.engine}: {exc.message}")
        except EngineUnavailable as exc:
            return _error(502, str(exc))
        except NoEngineError as exc:
            return _error(503, f"{path}: {exc}")
        except BaseExceptionGroup as group:  # a broadcast: report the first engine's failure
            first = group.exceptions[0]
            if isinstance(first, EngineError | EngineUnavailable):
                return _error(502, f"{path}: {first}")
            raise
        if empty or result is None:
            return _json({})
        if isinstance(result, str):
            return web.Response(text=result)
        return _json(result)

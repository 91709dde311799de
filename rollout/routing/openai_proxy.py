"""tether's router in front of the engines' OpenAI-compatible endpoints (`/v1/*`).

Agent code (tau-bench's tool adapter, coding agents) talks to engines through OpenAI clients.
`add_openai_routes(routes, router)` mounts `/v1/{path}` on an aiohttp application (the head's
router front for hooks, see front.py): each request goes to the engine the `Router`
picks, under its per-engine concurrency cap, by the `X-SMG-Routing-Key` header when the policy
hashes (so every turn of a session returns to its engine's cache), and the engine's answer is
passed back as it comes: status and JSON as they are (an engine's 400 in OpenAI's error shape
stays a 400), an SSE stream chunk by chunk. The front adds the run's engine key itself (the
Router's clients hold it), so agents never hold it. An engine that cannot be reached answers
502, no routed engine 503, both in SGLang's error shape.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from tether.rollout.engine_api.client import ROUTING_KEY_HEADER, EngineClient, EngineUnavailable
from tether.rollout.routing.router import NoEngineError, Router

OPENAI_PREFIX = "/v1/"
SERVED = ("GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "* /v1/*")


def _error(status: int, message: str) -> web.Response:
    body = {
        "object": "error",
        "message": message,
        "type": "ServiceUnavailable" if status == 503 else "BadGateway",
        "param": None,
        "code": status,
        "error": {"message": message, "type": "engine_error", "param": None, "code": status},
    }
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class OpenAIProxy:
    """Forwards one request at a time to a routed engine (see the module docstring)."""

    def __init__(self, router: Router, *, request_timeout: float | None = None) -> None:
        self.router = router
        self._timeout = request_timeout

    async def forward(self, request: web.Request) -> web.StreamResponse:
        data = await request.read() if request.body_exists else None
        key = request.headers.get(ROUTING_KEY_HEADER)
        headers = {ROUTING_KEY_HEADER: key} if key else None

        async def relay(client: EngineClient) -> web.StreamResponse:
            async with client.stream(
                request.method, request.path_qs, data, headers=headers, request_timeout=self._timeout
            ) as upstream:
                kind = upstream.headers.get("Content-Type", "application/json")
                if not kind.startswith("text/event-stream"):
                    body = await upstream.read()
                    return web.Response(body=body, status=upstream.status, headers={"Content-Type": kind})
                resp = web.StreamResponse(
                    status=upstream.status, headers={"Content-Type": kind, "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        try:
            return await self.router.call(key, relay)
        except EngineUnavailable as exc:
            return _error(502, f"{request.path}: {exc}")
        except NoEngineError as exc:
            return _error(503, f"{request.path}: {exc}")


def add_openai_routes(routes: web.UrlDispatcher, router: Router, **options: Any) -> OpenAIProxy:
    """Mount `/v1/{path}` (any method) on `routes`, forwarded to `router`'s engines."""
    proxy = OpenAIProxy(router, **options)
    routes.add_route("*", OPENAI_PREFIX + "{path:.*}", proxy.forward)
    return proxy


__all__ = ["SERVED", "OpenAIProxy", "add_openai_routes"]

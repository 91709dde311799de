"""--use-sglang-router without processes: the fronted Router sends requests to the sglang-router
and control (pause, resume, abort, broadcasts) to each engine directly; RouterWorkers changes the
router's worker list through its queued-job API. In-process aiohttp servers stand in for both."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from support.rollout import make_config

from tether.rollout.engine_api.client import EngineClient, EngineUnavailable
from tether.rollout.routing.router import NoEngineError, Router
from tether.rollout.routing.sglang_router_workers import RouterWorkers, WorkerListError
from tether.runtime.loop import run


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def fake_engine(calls: list[str]) -> web.Application:
    """Records each control call it gets."""

    async def control(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({})

    app = web.Application()
    for path in ("/pause_generation", "/continue_generation", "/abort_request"):
        app.router.add_post(path, control)
    return app


def fake_front(calls: list[str], generate_status: int = 502) -> web.Application:
    """An sglang-router: 404 for the engine control it does not serve, as 0.3.2 does."""

    async def refuse(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.Response(status=404)

    async def generate(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"error": "no worker reachable"}, status=generate_status)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_route("*", "/{tail:.*}", refuse)
    return app


def test_fronted_router_controls_each_engine_and_requests_go_through_the_front() -> None:
    async def main() -> None:
        front_calls: list[str] = []
        engine_calls: list[list[str]] = [[], []]
        async with (
            serve(fake_front(front_calls)) as front_url,
            serve(fake_engine(engine_calls[0])) as e0,
            serve(fake_engine(engine_calls[1])) as e1,
        ):
            cfg = make_config(rollout={"use_sglang_router": True}).rollout
            async with Router.from_config(cfg, [e0, e1], router_url=front_url, api_key="k") as router:
                assert router.front is not None and router.front.name == "sglang-router"
                assert [c.url for c in router.engines] == [e0, e1]
                assert router.pick().name == "sglang-router"
                await router.pause("abort")
                await router.abort_all()
                await router.resume()
                expected = ["/pause_generation", "/abort_request", "/continue_generation"]
                assert engine_calls == [expected, expected] and front_calls == []
                # the sglang-router's 502 (its worker gone) is the engine being unavailable
                with pytest.raises(EngineUnavailable, match="HTTP 502"):
                    await router.generate([1, 2], {"max_new_tokens": 1})
                assert front_calls == ["/generate"]

                # membership changes the engines behind, never the front
                removed = router.remove_engine("engine1")
                await removed.close()
                assert [c.url for c in router.engines] == [e0] and router.pick().name == "sglang-router"
                await router.abort_all()
                assert engine_calls[1] == expected  # no longer reached
                await router.remove_engine("engine0").close()
                with pytest.raises(NoEngineError):
                    await router.generate([1], {"max_new_tokens": 1})
                waiting = asyncio.ensure_future(router.wait_for_engine())
                await asyncio.sleep(0)
                assert not waiting.done()  # nothing behind the sglang-router: wait for an engine
                router.add_engine(EngineClient(e1, name="engine1"))
                async with asyncio.timeout(5):
                    await waiting
                async with EngineClient(e1, name="engine1") as twin:
                    with pytest.raises(ValueError, match="already routed"):
                        router.add_engine(twin)

    run(main())


def test_unfronted_router_does_not_hide_engine_errors() -> None:
    async def main() -> None:
        calls: list[str] = []
        async with serve(fake_front(calls, generate_status=503)) as url:
            async with Router([EngineClient(url, name="e0")]) as router:
                with pytest.raises(Exception, match="HTTP 503") as err:
                    await router.generate([1], {"max_new_tokens": 1})
                assert not isinstance(err.value, EngineUnavailable)

    run(main())


class FakeWorkerList:
    """sglang-router 0.3.2's worker API: changes are jobs applied `lag` list calls later."""

    def __init__(self, urls: list[str], lag: int = 2, key: str = "k") -> None:
        self.workers = {url: str(uuid.uuid4()) for url in urls}
        self.lag = lag
        self.key = key
        self.jobs: list[tuple[int, str, str]] = []  # (due list call, "add"/"remove", url)
        self.lists = 0
        self.added: list[dict[str, Any]] = []
        self.frozen = False

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/workers", self._list)
        app.router.add_post("/workers", self._add)
        app.router.add_delete("/workers/{id}", self._remove)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.Response(status=401)
        return await handler(request)

    async def _list(self, request: web.Request) -> web.Response:
        self.lists += 1
        if not self.frozen:
            for job in [j for j in self.jobs if j[0] <= self.lists]:
                self.jobs.remove(job)
                if job[1] == "add":
                    self.workers[job[2]] = str(uuid.uuid4())
                else:
                    self.workers.pop(job[2], None)
        workers = [
            {"id": i, "url": u, "is_healthy": True, "worker_type": "regular"} for u, i in self.workers.items()
        ]
        return web.json_response({"workers": workers, "total": len(workers)})

    async def _add(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.added.append(body)
        self.jobs.append((self.lists + self.lag, "add", body["url"]))
        return web.json_response({"status": "accepted"}, status=202)

    async def _remove(self, request: web.Request) -> web.Response:
        url = next((u for u, i in self.workers.items() if i == request.match_info["id"]), None)
        if url is None:
            return web.json_response({"error": "not found"}, status=404)
        self.jobs.append((self.lists + self.lag, "remove", url))
        return web.json_response({"status": "accepted"}, status=202)


def test_router_workers_wait_for_each_queued_change() -> None:
    async def main() -> None:
        fake = FakeWorkerList(["http://a:1", "http://b:2"])
        async with serve(fake.app()) as url, RouterWorkers(url, api_key="k", poll_interval=0.01) as workers:
            assert sorted(await workers.workers()) == ["http://a:1", "http://b:2"]
            assert await workers.remove("http://b:2")
            assert sorted(await workers.workers()) == ["http://a:1"]
            assert not await workers.remove("http://b:2")  # not listed: nothing to do
            await workers.add("http://b:2")
            assert sorted(await workers.workers()) == ["http://a:1", "http://b:2"]
            assert fake.added == [{"url": "http://b:2", "api_key": "k", "worker_type": "regular"}]
            # a stale entry at the same address is replaced, not left beside the new process
            stale = fake.workers["http://a:1"]
            await workers.add("http://a:1")
            assert fake.workers["http://a:1"] != stale
            await workers.add("http://p:3", worker_type="prefill", bootstrap_port=8998)
            assert fake.added[-1] == {
                "url": "http://p:3",
                "api_key": "k",
                "worker_type": "prefill",
                "bootstrap_port": 8998,
            }

    run(main())


def test_router_workers_name_what_the_router_did_not_apply() -> None:
    async def main() -> None:
        fake = FakeWorkerList(["http://a:1"])
        fake.frozen = True
        async with (
            serve(fake.app()) as url,
            RouterWorkers(url, api_key="k", timeout=0.3, poll_interval=0.01) as workers,
        ):
            with pytest.raises(
                WorkerListError, match=r"did not add http://b:2 within .* lists \['http://a:1'\]"
            ):
                await workers.add("http://b:2")
            with pytest.raises(WorkerListError, match="did not remove http://a:1"):
                await workers.remove("http://a:1")

    run(main())

"""--http-proxy: calls to other hosts (a remote reward model, a hook's slime `post`) go through the
proxy; calls to loopback (engines, router, local services) never do. The proxy here is a stand-in
on 127.0.0.1 that answers forwarded requests itself, so no traffic leaves the machine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from support.rollout import make_config

from tether.config import resolve
from tether.rollout.config import RolloutConfig
from tether.rollout.http_proxy import proxy_for
from tether.rollout.rewards.scoring import RewardModel
from tether.rollout.rollout_fn import RolloutContext, using_context
from tether.rollout.routing.router import Router
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError

REMOTE = "http://reward.invalid/score"  # .invalid never resolves: only a proxy can answer it


@asynccontextmanager
async def server(answer: float, seen: list[str]) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 that records each request's target and answers `answer`."""

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.raw_path)  # a proxy is asked for the absolute URL, a server for its path
        return web.json_response(answer)

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def sample() -> Sample:
    return Sample(index=0, prompt="2+2", response="4", label="4", tokens=[1, 2], response_length=1)


def test_proxy_for_skips_loopback() -> None:
    proxy = "http://proxy.internal:3128"
    assert proxy_for("http://10.0.0.5/rm", proxy) == proxy
    assert proxy_for("https://rm.example.com/score", proxy) == proxy
    for local in ("http://127.0.0.1:8000/generate", "http://localhost/x", "http://[::1]:9/x"):
        assert proxy_for(local, proxy) is None
    assert proxy_for("http://10.0.0.5/rm", None) is None


def test_the_remote_reward_model_is_reached_through_the_proxy() -> None:
    async def scenario() -> None:
        via_proxy: list[str] = []
        direct: list[str] = []
        async with server(0.75, via_proxy) as proxy, server(0.25, direct) as local:
            cfg = RolloutConfig(rm_type="remote_rm", rm_url=REMOTE, http_proxy=proxy)
            async with RewardModel(cfg) as rm:
                assert await rm.score(sample()) == 0.75
            cfg = RolloutConfig(rm_type="remote_rm", rm_url=f"{local}/score", http_proxy=proxy)
            async with RewardModel(cfg) as rm:
                assert await rm.score(sample()) == 0.25
        assert via_proxy == [REMOTE]  # the proxy was asked for the remote URL, once
        assert direct == ["/score"]  # the loopback service was reached directly

    asyncio.run(scenario())


def test_a_hooks_slime_post_to_another_host_takes_the_proxy() -> None:
    from tether.rollout.slime_api.utils.http_utils import post

    async def scenario() -> None:
        seen: list[str] = []
        async with server(0.5, seen) as proxy:
            config = make_config({"http_proxy": proxy})
            async with RolloutContext(config, Router()) as ctx:
                with using_context(ctx):
                    assert await post("http://judge.invalid/v1", {"q": 1}, max_retries=1) == 0.5
        assert seen == ["http://judge.invalid/v1"]

    asyncio.run(scenario())


def test_a_proxy_must_be_an_http_url() -> None:
    assert resolve(["--http-proxy", "http://127.0.0.1:3128"]).rollout.http_proxy == "http://127.0.0.1:3128"
    with pytest.raises(ConfigError) as err:
        resolve(["--http-proxy", "socks5://127.0.0.1:1080"])
    assert (err.value.key, err.value.value) == ("--http-proxy", "socks5://127.0.0.1:1080")

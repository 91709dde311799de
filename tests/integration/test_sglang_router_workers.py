"""--use-sglang-router with the real router (sglang-router 0.3.2 from the SGLang venv) over two
CPU engines: the pool's worker-list calls take an engine out of its list and put it back, and
the fronted Router's pause and abort reach each engine (the router itself answers 404)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.engines import ENGINE_KEY, EngineFactory, engine_client, find_sglang_python
from support.net import free_port
from support.rollout import make_config

from tether.rollout.engine_api.client import EngineClient, EngineError, GenerateResponse
from tether.rollout.routing.router import Router
from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_spec, start_router
from tether.rollout.routing.sglang_router_workers import RouterWorkers
from tether.runtime.loop import run
from tether.runtime.process.supervisor import Supervisor
from tether.runtime.rpc.secret import new_secret

pytestmark = pytest.mark.sglang
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}


async def abort_until_done(router: Router, requests: list[asyncio.Future[GenerateResponse]]) -> None:
    """Abort through `router` until every request came back (one may reach its engine late)."""
    async with asyncio.timeout(60):
        while not all(r.done() for r in requests):
            await router.abort_all()
            await asyncio.wait(requests, timeout=0.1)


def test_engine_leaves_and_rejoins_the_real_router_and_control_reaches_each_engine(
    cpu_engine: EngineFactory, tmp_path: Path
) -> None:
    python, missing = find_sglang_python()
    if python is None:
        pytest.skip(f"real SGLang unavailable: {missing}")
    engines = [cpu_engine(index=0), cpu_engine(index=1)]
    launches = [e.launch for e in engines]
    assert all(launch is not None for launch in launches)
    urls = [e.url for e in engines]

    async def main() -> None:
        cfg = RouterLaunchConfig(port=free_port(), policy="round_robin", api_key=ENGINE_KEY, python=python)
        async with Supervisor(tmp_path / "run", new_secret()) as sup:
            _, url = await start_router(sup, router_spec([x for x in launches if x is not None], cfg), cfg)
            rollout = make_config(rollout={"use_sglang_router": True}).rollout
            async with (
                Router.from_config(rollout, urls, router_url=url, api_key=ENGINE_KEY) as router,
                RouterWorkers(url, api_key=ENGINE_KEY) as workers,
                engine_client(urls[0]) as first,
                engine_client(urls[1]) as second,
            ):
                assert sorted(await workers.workers()) == sorted(urls)
                # The router itself does not serve engine control: it must not be what is asked.
                with pytest.raises(EngineError) as refused:
                    await router.front.pause_generation("abort")  # type: ignore[union-attr]
                assert refused.value.status == 404

                # An engine taken out (as the pool does for a dead one) gets no request through it.
                await workers.remove(urls[1])
                router.remove_engine("engine1").retire()
                assert list(await workers.workers()) == [urls[0]]
                before = await requests_served(second)
                for i in range(6):
                    await router.generate([5, 6, 7 + i], {"max_new_tokens": 2})
                assert await requests_served(second) == before
                # ... and back in (a restarted or rejoined engine): it is routed to again.
                await workers.add(urls[1])
                router.add_engine(EngineClient(urls[1], name="engine1", api_key=ENGINE_KEY))
                assert sorted(await workers.workers()) == sorted(urls)
                for i in range(6):
                    await router.generate([5, 6, 7 + i], {"max_new_tokens": 2})
                assert await requests_served(second) > before

                # Abort and pause go to each engine directly.
                longs = [asyncio.ensure_future(c.generate([5, 6, 7], LONG)) for c in (first, second)]
                await abort_until_done(router, longs)
                assert [r.result().finish_type for r in longs] == ["abort", "abort"]
                longs = [asyncio.ensure_future(c.generate([5, 6, 8], LONG)) for c in (first, second)]
                async with asyncio.timeout(60):
                    while not all(r.done() for r in longs):
                        await router.pause("abort")  # aborts what runs and holds what comes
                        await asyncio.wait(longs, timeout=0.1)
                assert [r.result().finish_type for r in longs] == ["abort", "abort"]
                assert [(await state(c))["paused"] for c in (first, second)] == [True, True]
                await router.resume()
                assert [(await state(c))["paused"] for c in (first, second)] == [False, False]
                _, answer = await router.generate([5, 6, 7], {"max_new_tokens": 2})
                assert answer.finish_type == "length"

    run(main())


async def state(client: EngineClient) -> dict[str, Any]:
    """The CPU engine's scheduler state (its /get_server_info `internal_states`)."""
    states = (await client.get_server_info())["internal_states"]
    assert isinstance(states, list)
    return dict(states[0])


async def requests_served(client: EngineClient) -> int:
    """Tokens the CPU engine has generated: grows with each request it serves."""
    return int((await state(client))["tokens_generated"])

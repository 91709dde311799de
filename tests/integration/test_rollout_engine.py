"""The rollout against real CPU engine processes: client, routing, rollout semantics, hooks, fully-async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import SLOW_ENGINE, cpu_engine, engine_client
from support.rollout import make_config

from tether.bench.slow_engine import delay_argv
from tether.rollout.data_source import DataSource, PromptRecord, load_tokenizer
from tether.rollout.engine_api.client import EngineClient, EngineError, EngineUnavailable
from tether.rollout.fully_async import FullyAsyncWorker
from tether.rollout.hooks import HookError
from tether.rollout.rollout_fn import (
    RolloutContext,
    generate_group,
    run_rollout,
    sampling_params,
    using_context,
)
from tether.rollout.router import Router
from tether.rollout.sample import TRAINABLE, SampleStatus


class Engines:
    def __init__(self, model: Path, fast: list[str], slow: str) -> None:
        self.model, self.fast, self.slow = model, fast, slow


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    root = tmp_path_factory.mktemp("rollout_engines")
    version = ("--weight-version", "0")
    slow = delay_argv("constant", 120000)
    with (
        cpu_engine(tiny_model, root, *version) as a,
        cpu_engine(tiny_model, root, *version) as b,
        cpu_engine(tiny_model, root, *version, *slow, module=SLOW_ENGINE) as s,
    ):
        yield Engines(tiny_model, [a.url, b.url], s.url)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def records(engines: Engines, n: int) -> list[PromptRecord]:
    tok = load_tokenizer(str(engines.model))
    return [
        PromptRecord(
            prompt=f"question {i}", tokens=tok.encode(f"question {i}", add_special_tokens=False), label=str(i)
        )
        for i in range(n)
    ]


def write_hooks(tmp_path: Path) -> Path:
    path = tmp_path / "hooks_mod.py"
    path.write_text(
        "from tether.rollout.rollout_fn import current_context, generate_one\n"
        "async def reward(args, sample):\n"
        "    return float(sample.response_length % 2)\n"
        "async def group_reward(args, samples):\n"
        "    return [float(i) for i in range(len(samples))]\n"
        "def drop_multiple_of_three(args, samples):\n"
        "    return samples[0].group_index % 3 != 0\n"
        "async def good_generate(args, sample, sampling_params):\n"
        "    assert args.rollout_temperature == 1.0  # slime-style flat attribute\n"
        "    return await generate_one(current_context(), sample, sampling_params)\n"
        "async def bad_generate(args, sample, sampling_params):\n"
        "    sample = await generate_one(current_context(), sample, sampling_params)\n"
        "    sample.loss_mask = sample.loss_mask[:-1]\n"
        "    return sample\n"
    )
    return path


def test_client_generate_abort_and_errors(engines: Engines) -> None:
    async def main() -> None:
        async with engine_client(engines.fast[0]) as client:
            resp = await client.generate(
                [5, 6, 7], {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            )
            assert len(resp.output_ids) == 6 and resp.finish_type == "length"
            assert all(lp <= 0 for lp in resp.log_probs()) and resp.weight_version == "0"
            long = asyncio.ensure_future(
                client.generate([5, 6, 7], {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0})
            )
            async with asyncio.timeout(30):  # abort until the request (sent concurrently) is caught
                while not long.done():
                    await client.abort_all()
                    await asyncio.wait([long], timeout=0.1)
            aborted = long.result()
            assert aborted.finish_type == "abort" and len(aborted.output_ids) < 1500
            with pytest.raises(EngineError) as err:
                await client.generate([5] * 3000, {"max_new_tokens": 4})
            assert err.value.status == 400 and err.value.message

    run(main())


def test_retiring_a_hung_engine_abandons_its_requests_at_once(engines: Engines) -> None:
    """A request waiting on an engine declared hung ends with EngineUnavailable when the client
    is retired, not at the request timeout; the task that made it is not cancelled."""

    async def main() -> None:
        async with engine_client(engines.slow, request_timeout=600) as client:
            waiting = asyncio.ensure_future(client.generate([5, 6, 7], {"max_new_tokens": 2}))
            for _ in range(100_000):  # until the request is on its way
                if client._in_flight:
                    break
                await asyncio.sleep(0)
            client.retire(abandon_in_flight=True)
            async with asyncio.timeout(5):
                with pytest.raises(EngineUnavailable, match="declared hung"):
                    await waiting
            assert not waiting.cancelled() and not client._in_flight
            with pytest.raises(EngineUnavailable, match="taken out of routing"):
                await client.generate([5], {"max_new_tokens": 1})

    run(main())


def test_consistent_hash_routing_keeps_sessions_on_their_engine(engines: Engines) -> None:
    async def main() -> None:
        clients = [engine_client(u, name=f"e{i}") for i, u in enumerate(engines.fast)]
        async with Router(clients, policy="consistent_hash") as router:
            params = {"max_new_tokens": 2, "temperature": 1.0}
            first = {}
            for turn in range(2):
                for i in range(12):
                    name, _ = await router.generate([5, 6, 7 + i], params, routing_key=f"s{i}")
                    if turn == 0:
                        first[i] = name
                    else:
                        assert name == first[i]
            assert set(first.values()) == {"e0", "e1"}
            assert sum(r.requests for r in router.stats()) == 24

    run(main())


def test_abort_all_skips_an_unreachable_engine_and_aborts_the_others(
    engines: Engines, free_port: int
) -> None:
    """An engine that died is skipped (the pool restarts it); the live ones are still aborted."""
    dead = f"http://127.0.0.1:{free_port}"  # a port nobody listens on: the dead engine

    async def main() -> None:
        live = engine_client(engines.fast[0], name="live")
        async with Router([live, engine_client(dead, name="dead", request_timeout=5)]) as router:
            long = asyncio.ensure_future(
                live.generate([5, 6, 7], {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0})
            )
            async with asyncio.timeout(30):
                while not long.done():
                    await router.abort_all()
                    await asyncio.wait([long], timeout=0.1)
            assert long.result().finish_type == "abort"

    run(main())


def _router(urls: list[str], policy: Any = "round_robin") -> Router:
    return Router([engine_client(u, name=f"e{i}") for i, u in enumerate(urls)], policy=policy)


def test_default_rollout_group_semantics(engines: Engines, tmp_path: Path) -> None:
    hooks = write_hooks(tmp_path)
    cfg = make_config(
        rollout={"rollout_max_response_len": 12, "custom_rm_path": f"{hooks}:reward"},
        data={"rollout_batch_size": 3, "n_samples_per_prompt": 4},
    )
    ds = DataSource(records(engines, 10), n_samples_per_prompt=4)

    async def main() -> list[list[Any]]:
        async with RolloutContext(cfg, _router(engines.fast)) as ctx:
            with using_context(ctx):
                groups = await run_rollout(ctx, 7, ds)
            assert ctx.metrics["rollout/samples"] == 12
            return groups

    groups = run(main())
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    indices = [s.index for g in groups for s in g]
    assert indices == sorted(indices)
    for g in groups:
        assert len({tuple(s.tokens[: s.prompt_length]) for s in g}) == 1
        for s in g:
            assert s.rollout_id == 7 and s.status in TRAINABLE and s.reward == float(s.response_length % 2)
            assert len(s.rollout_log_probs or []) == s.response_length and s.weight_versions == ["0"]


def test_dynamic_filter_and_over_sampling_abort_surplus(engines: Engines, tmp_path: Path) -> None:
    hooks = write_hooks(tmp_path)
    for partial in (False, True):
        cfg = make_config(
            rollout={
                "rollout_max_response_len": 8,
                "custom_rm_path": f"{hooks}:group_reward",
                "group_rm": True,
                "dynamic_sampling_filter_path": f"{hooks}:drop_multiple_of_three",
                "over_sampling_batch_size": 6,
                "partial_rollout": partial,
            },
            data={"rollout_batch_size": 2, "n_samples_per_prompt": 1},
        )
        ds = DataSource(records(engines, 20), n_samples_per_prompt=1)

        async def main(cfg: Any = cfg, ds: DataSource = ds) -> tuple[list[list[Any]], dict[str, float]]:
            # round robin: groups 0, 2, 4 go to the fast engine, 1, 3, 5 to the one that never answers
            async with RolloutContext(cfg, _router([engines.fast[0], engines.slow])) as ctx:
                with using_context(ctx):
                    groups = await run_rollout(ctx, 0, ds)
                return groups, ctx.metrics

        groups, metrics = run(main())
        assert [g[0].group_index for g in groups] == [2, 4]
        assert all(s.status in TRAINABLE for g in groups for s in g)  # no aborted sample handed on
        # group 0 is filtered, unless it finishes after the batch is full (then it is surplus)
        assert metrics["rollout/filtered_groups"] + metrics["rollout/surplus_groups"] == 1
        assert metrics["rollout/aborted_groups"] == 3
        if partial:
            again = [g[0].group_index for g in ds.get_samples(ds.buffer_size)]
            assert {1, 3, 5} <= set(again) and again == sorted(again)
        else:
            assert ds.buffer_size == 0


def test_partial_rollout_continues_across_a_weight_update(engines: Engines) -> None:
    cfg = make_config(
        rollout={"partial_rollout": True, "mask_offpolicy_in_partial_rollout": True},
        data={"n_samples_per_prompt": 2},
    )
    ds = DataSource(records(engines, 2), n_samples_per_prompt=2)

    async def main() -> None:
        client = engine_client(engines.fast[1], name="e")
        async with RolloutContext(cfg, Router([client])) as ctx, client:
            params = {**sampling_params(cfg.rollout), "max_new_tokens": 1200, "ignore_eos": True}
            group = ds.get_samples(1)[0]
            with using_context(ctx):
                task = asyncio.ensure_future(generate_group(ctx, group, params, score=False))
                await _until(lambda: ctx.router.in_flight() == 2, 30)
                # Abort only once both requests have produced tokens, so the first segment is
                # never empty and the off-policy masking below is always exercised.
                start = await _tokens_generated(client)
                async with asyncio.timeout(30):
                    while await _tokens_generated(client) < start + 8:  # noqa: ASYNC110 - polling the engine's counter
                        await asyncio.sleep(0.02)
                async with asyncio.timeout(30):
                    while not task.done():
                        await client.abort_all()
                        await asyncio.wait([task], timeout=0.1)
                group = task.result()
                assert all(s.status == SampleStatus.ABORTED for s in group)
                first = [list(s.tokens) for s in group]
                await client.update_weight_version("1")
                params["max_new_tokens"] = 1200
                group = await generate_group(ctx, group, params, score=False)
        for s, before in zip(group, first, strict=True):
            assert s.status == SampleStatus.TRUNCATED and s.response_length == 1200
            assert s.tokens[: len(before)] == before  # the partial tokens are kept, not regenerated
            n1 = s.metadata["segment_lengths"][0]
            assert n1 > 0
            if n1:
                assert s.weight_versions == ["0", "1"]
                assert s.loss_mask == [0] * n1 + [1] * (1200 - n1)  # off-policy segment masked
                assert all(lp == 0.0 for lp in (s.rollout_log_probs or [])[:n1])

    run(main())


def test_generate_hook_good_and_bad_output(engines: Engines, tmp_path: Path) -> None:
    hooks = write_hooks(tmp_path)
    for name in ("good_generate", "bad_generate"):
        cfg = make_config(
            rollout={
                "rollout_max_response_len": 6,
                "custom_generate_function_path": f"{hooks}:{name}",
                "custom_rm_path": f"{hooks}:reward",
            },
            data={"rollout_batch_size": 2, "n_samples_per_prompt": 2},
        )
        ds = DataSource(records(engines, 4), n_samples_per_prompt=2)

        async def main(cfg: Any = cfg, ds: DataSource = ds) -> list[list[Any]]:
            async with RolloutContext(cfg, _router(engines.fast)) as ctx:
                with using_context(ctx):
                    return await run_rollout(ctx, 0, ds)

        if name == "good_generate":
            assert len(run(main())) == 2
        else:
            with pytest.raises(HookError) as err:
                run(main())
            assert err.value.path == f"{hooks}:bad_generate" and err.value.field == "loss_mask"


def _async_cfg(**rollout: Any) -> Any:
    return make_config(
        rollout={"rollout_max_response_len": 6, "rm_type": "exact_match", **rollout},
        data={"rollout_batch_size": 2, "n_samples_per_prompt": 2},
    )


async def _tokens_generated(client: EngineClient) -> int:
    info = await client.get_server_info()
    return int(info["internal_states"][0]["tokens_generated"])


async def _until(predicate: Any, seconds: float = 60.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 - polling state owned by another task, with a deadline
            await asyncio.sleep(0.02)


def test_fully_async_ordering_and_backpressure(engines: Engines) -> None:
    ds = DataSource(records(engines, 30), n_samples_per_prompt=2)

    async def main() -> None:
        async with RolloutContext(_async_cfg(), _router(engines.fast, "least_in_flight")) as ctx:
            async with FullyAsyncWorker(ctx, ds, max_in_flight=3) as worker:
                for rollout_id in range(2):
                    batch = await worker.get_batch(2, rollout_id)
                    idx = [s.index for g in batch for s in g]
                    assert idx == sorted(idx) and all(s.rollout_id == rollout_id for g in batch for s in g)
                    assert all(s.status in TRAINABLE and s.reward is not None for g in batch for s in g)
                # nobody consumes now: drawing stops once the queue holds the in-flight cap
                await _until(
                    lambda: worker.metrics().in_flight_groups == 0 and worker.metrics().queue_length >= 3
                )
                m = worker.metrics()
                drawn = ds.state_dict().next_group_index
                assert drawn == m.queue_length + m.handed_over_groups  # nothing else was drawn
                assert m.queue_length <= 2 * 3 and m.queue_age_seconds >= 0
                # a checkpoint now keeps the queued prompts: a resumed source serves them first
                pending = worker.unconsumed_groups()
                queued = sorted(g[0].group_index for g in pending)
            state = ds.state_dict(pending=pending)
        resumed = DataSource(records(engines, 30), n_samples_per_prompt=2)
        resumed.load_state_dict(state)
        again = resumed.get_samples(len(queued) + 1)
        assert sorted(g[0].group_index for g in again[:-1]) == queued
        assert again[-1][0].group_index == drawn  # and then the next fresh prompt, none skipped
        assert all(s.response_length == 0 for g in again for s in g)

    run(main())


def test_fully_async_pause_requeues_aborted_groups(engines: Engines) -> None:
    ds = DataSource(records(engines, 30), n_samples_per_prompt=2)

    async def main() -> None:
        # every sample also goes to the engine that never answers, so every group is in flight at pause
        async with RolloutContext(_async_cfg(), _router([engines.fast[0], engines.slow])) as ctx:
            async with FullyAsyncWorker(ctx, ds, max_in_flight=2) as worker:
                await _until(lambda: worker.metrics().in_flight_groups == 2)
                await worker.pause()
                m = worker.metrics()
                assert m.in_flight_groups == 0 and m.aborted_groups >= 2 and m.requeued_groups >= 2
                assert ds.buffer_size >= 2
                assert all(s.response_length == 0 for g in ds.state_dict().buffer for s in g)
                await ctx.router.remove_engine(
                    "e1"
                ).close()  # the restart path: carry on with the healthy one
                await worker.resume(weight_version=0)
                batch = await worker.get_batch(2, 0)
                assert all(s.status in TRAINABLE for g in batch for s in g)

    run(main())


def test_fully_async_staleness_drops_or_requeues(engines: Engines) -> None:
    for requeue in (False, True):
        ds = DataSource(records(engines, 40), n_samples_per_prompt=2)
        cfg = _async_cfg(max_weight_staleness=1, fully_async_requeue_stale_groups=requeue)

        async def main(cfg: Any = cfg, ds: DataSource = ds, requeue: bool = requeue) -> None:
            async with RolloutContext(cfg, _router(engines.fast)) as ctx:
                # the engines serve version "0"; the trainer is at 5, so every group lags by 5 > 1
                async with FullyAsyncWorker(ctx, ds, max_in_flight=2, weight_version=5) as worker:
                    key = "stale_requeued_groups" if requeue else "stale_dropped_groups"
                    await _until(lambda: getattr(worker.metrics(), key) >= 3)
                    assert worker.metrics().queue_length == 0
                    worker.set_weight_version(1)  # lag 1 is allowed
                    batch = await worker.get_batch(2, 0)
                    assert len(batch) == 2
                    if requeue:
                        assert worker.metrics().stale_dropped_groups == 0

        run(main())

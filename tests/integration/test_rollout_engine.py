"""The rollout against real CPU engine processes: client, routing, rollout semantics, hooks, fully-async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import SLOW_ENGINE, cpu_engine, engine_client
from support.rollout import make_config

from tether.bench.engines.slow_engine import delay_argv
from tether.rollout.data.source import DataSource, PromptRecord, load_tokenizer
from tether.rollout.engine_api.client import EngineClient, EngineError, EngineUnavailable
from tether.rollout.fully_async import FullyAsyncWorker
from tether.rollout.hooks.calls import HookError
from tether.rollout.rollout_fn import (
    RolloutContext,
    generate_group,
    run_rollout,
    sampling_params,
    using_context,
)
from tether.rollout.routing.router import Router
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


def test_slime_sample_filter_and_all_samples_process(engines: Engines, tmp_path: Path) -> None:
    """--rollout-sample-filter-path marks samples `remove_sample` (slime's Samples): they stay in
    the batch with an all-zero loss mask. --rollout-all-samples-process-path then sees every
    finished group, the one the dynamic filter dropped too, with the data source."""
    hooks = write_hooks(tmp_path)
    slime_hooks = tmp_path / "slime_end_hooks.py"
    slime_hooks.write_text(
        "from slime.utils.types import Sample\n"
        "seen = []\n"
        "def remove_odd(args, samples):\n"
        "    assert all(isinstance(s, Sample) for s in samples)\n"
        "    for s in samples:\n"
        "        s.remove_sample = s.index % 2 == 1\n"
        "def process_all(args, all_samples, data_source):\n"
        "    seen.append(([[s.index for s in g] for g in all_samples], data_source.buffer_size))\n"
    )
    cfg = make_config(
        rollout={
            "rollout_max_response_len": 6,
            "custom_rm_path": f"{hooks}:reward",
            "dynamic_sampling_filter_path": f"{hooks}:drop_multiple_of_three",
            "rollout_sample_filter_path": f"{slime_hooks}:remove_odd",
            "rollout_all_samples_process_path": f"{slime_hooks}:process_all",
        },
        data={"rollout_batch_size": 2, "n_samples_per_prompt": 2},
    )
    ds = DataSource(records(engines, 10), n_samples_per_prompt=2)

    async def main() -> list[list[Any]]:
        async with RolloutContext(cfg, _router(engines.fast)) as ctx:
            with using_context(ctx):
                return await run_rollout(ctx, 0, ds)

    groups = run(main())
    assert [g[0].group_index for g in groups] == [1, 2]
    for s in (s for g in groups for s in g):
        mask = s.loss_mask or []
        assert len(mask) == s.response_length > 0
        assert (not any(mask)) if s.index % 2 == 1 else all(mask), (s.index, mask)
    import sys

    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(slime_hooks))
    ((all_groups, buffered),) = module.seen
    seen_groups = [g[0] // 2 for g in all_groups]
    # in draw order, the kept groups and group 0 that the dynamic filter dropped (3 too, when drawn)
    assert seen_groups == sorted(seen_groups) and {0, 1, 2} <= set(seen_groups) <= {0, 1, 2, 3}
    assert buffered == 0


def test_slime_log_hooks_and_reward_category(engines: Engines, tmp_path: Path) -> None:
    """--custom-rollout-log-function-path and --custom-eval-rollout-log-function-path get slime's
    arguments; a True return drops tether's own figures of that step (slime's meaning), a False one
    keeps them. --log-reward-category logs the share of each value of a dict reward's key."""
    import json

    from tether.run.rollout_manager import RolloutManager

    hooks = tmp_path / "log_hooks.py"
    hooks.write_text(
        "calls = []\n"
        "async def reward(args, sample):\n"
        "    return {'score': 1.0, 'kind': 'even' if sample.response_length % 2 == 0 else 'odd'}\n"
        "def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):\n"
        "    calls.append(('rollout', rollout_id, len(samples), sorted(rollout_extra_metrics), rollout_time))\n"
        "    return rollout_id == 1\n"
        "def log_eval(rollout_id, args, data, extra_metrics):\n"
        "    calls.append(('eval', rollout_id, {k: sorted(v) for k, v in data.items()}, len(data['held']['samples'])))\n"
        "    return True\n"
    )
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"input": f"q{i}", "label": "x"}) + "\n" for i in range(3)))
    cfg = make_config(
        rollout={
            "rollout_max_response_len": 5,
            "custom_rm_path": f"{hooks}:reward",
            "reward_key": "score",
            "log_reward_category": "kind",
            "log_multi_turn": True,
            "custom_rollout_log_function_path": f"{hooks}:log_rollout",
            "custom_eval_rollout_log_function_path": f"{hooks}:log_eval",
        },
        data={"rollout_batch_size": 2, "n_samples_per_prompt": 2, "eval_prompt_data": ["held", str(held)]},
    )

    async def main() -> list[dict[str, float]]:
        manager = RolloutManager(cfg, None)
        async with RolloutContext(
            cfg, _router(engines.fast), tokenizer=load_tokenizer(str(engines.model))
        ) as ctx:
            manager.ctx, manager.data = ctx, DataSource(records(engines, 6), n_samples_per_prompt=2)
            first = await manager.generate(0)
            kept = dict(manager.metrics)
            await manager.generate(1)
            dropped = dict(manager.metrics)
            evaluated = await manager.evaluate(1)
            assert sum(len(g) for g in first) == 4
            return [kept, dropped, evaluated]

    kept, dropped, evaluated = run(main())
    shares = {k: v for k, v in kept.items() if k.startswith("error_cat/")}
    assert shares and set(shares) <= {"error_cat/even", "error_cat/odd"} and sum(shares.values()) == 1.0
    assert kept["rollout/samples"] == 4  # the hook returned False at rollout 0: tether's figures stay
    assert kept["multi_turn/wo_obs_response_length/response_length_max"] <= 5  # --log-multi-turn
    assert not any(k.startswith(("rollout/", "perf/")) for k in dropped)  # True at rollout 1: dropped
    assert evaluated == {}  # the eval hook returned True
    import sys

    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(hooks))
    rollout_calls = [c for c in module.calls if c[0] == "rollout"]
    assert [c[1:3] for c in rollout_calls] == [(0, 4), (1, 4)]
    assert "rollout/reward_mean" in rollout_calls[0][3] and rollout_calls[0][4] > 0
    assert [c for c in module.calls if c[0] == "eval"] == [
        ("eval", 1, {"held": ["rewards", "samples", "truncated"]}, 3)
    ]


def test_eval_config_datasets_each_with_their_settings(engines: Engines, tmp_path: Path) -> None:
    """--eval-config: each dataset generated with its own sample count, response length, prompt key
    and reward (its custom_rm_path, or the rollout's with its metadata), through the real engine."""
    import json

    from tether.rollout.evaluation import run_evaluation

    hooks = tmp_path / "eval_hooks.py"
    hooks.write_text(
        "async def length(args, sample):\n    return float(sample.response_length)\n"
        "async def tagged(args, sample):\n    return 1.0 if sample.metadata.get('source') == 'b' else -1.0\n"
    )
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"q": f"a{i}"}) + "\n" for i in range(2)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"input": f"b{i}"}) + "\n" for i in range(3)))
    (tmp_path / "eval.yaml").write_text(
        "eval:\n"
        "  defaults: {max_response_len: 3}\n"
        "  datasets:\n"
        f"    a: {{path: {tmp_path / 'a.jsonl'}, input_key: q, n_samples_per_eval_prompt: 2,"
        f" custom_rm_path: '{hooks}:length'}}\n"
        f"    b: {{path: {tmp_path / 'b.jsonl'}, max_response_len: 5, metadata_overrides: {{source: b}}}}\n"
    )
    cfg = make_config(
        rollout={"custom_rm_path": f"{hooks}:tagged"},
        data={"eval_config": str(tmp_path / "eval.yaml")},
    )

    async def main() -> tuple[dict[str, float], dict[str, Any]]:
        data: dict[str, Any] = {}
        async with RolloutContext(
            cfg, _router(engines.fast), tokenizer=load_tokenizer(str(engines.model))
        ) as ctx:
            return await run_evaluation(ctx, 0, data), data

    metrics, data = run(main())
    assert metrics["eval/a/samples"] == 4 and metrics["eval/b/samples"] == 3
    a_lengths = [s.response_length for s in data["a"]["samples"]]
    assert max(a_lengths) <= 3 and data["a"]["rewards"] == [float(n) for n in a_lengths]  # its own reward
    assert max(s.response_length for s in data["b"]["samples"]) <= 5
    assert data["b"]["rewards"] == [1.0, 1.0, 1.0]  # the rollout's reward saw the dataset's metadata


def test_eval_function_path_replaces_the_evaluation(engines: Engines, tmp_path: Path) -> None:
    """--eval-function-path: the evaluation is that function's, called with evaluation=True; a
    tether-API one returns figures, a slime-API one slime's data by dataset."""
    from tether.run.rollout_manager import RolloutManager

    hooks = tmp_path / "eval_fns.py"
    hooks.write_text(
        "async def figures(args, rollout_id, data_source, evaluation=False):\n"
        "    assert evaluation is True\n"
        "    return {'eval/custom/score': 0.25 + rollout_id}\n"
    )
    slime_hooks = tmp_path / "slime_eval_fns.py"
    slime_hooks.write_text(
        "from slime.rollout.base_types import RolloutFnEvalOutput\n"
        "def by_dataset(args, rollout_id, data_source, evaluation=False):\n"
        "    return RolloutFnEvalOutput(data={'mine': {'rewards': [1.0, 0.0], 'truncated': [False, True]}})\n"
    )
    got = []
    for path in (f"{hooks}:figures", f"{slime_hooks}:by_dataset"):
        cfg = make_config(rollout={"eval_function_path": path})

        async def main(cfg: Any = cfg) -> dict[str, float]:
            manager = RolloutManager(cfg, None)
            async with RolloutContext(cfg, _router(engines.fast)) as ctx:
                manager.ctx = ctx
                return await manager.evaluate(2)

        got.append(run(main()))
    assert got[0] == {"eval/custom/score": 2.25}
    assert got[1]["eval/mine/reward_mean"] == 0.5 and got[1]["eval/mine/truncated_ratio"] == 0.5


def test_rollout_sample_hooks_run_in_order_before_the_reward(engines: Engines, tmp_path: Path) -> None:
    """--rollout-sample-hook-path, given twice on the command line: each generated sample goes
    through both hooks in order (a slime-API one changing slime's Sample in place, a plain one
    returning a Sample), with the keywords their signatures take, before its reward."""
    from tether.config import resolve

    sample_hooks = tmp_path / "sample_hooks.py"
    sample_hooks.write_text(
        "from slime.utils.types import Sample\n"
        "async def first(args, sample, *, rollout_id=None, evaluation=False):\n"
        "    assert isinstance(sample, Sample)\n"
        "    sample.metadata['trail'] = [f'first:{rollout_id}:{evaluation}']\n"
        "def second(args, sample, **kwargs):\n"
        "    sample.metadata['trail'] = sample.metadata['trail'] + [f'second:{sorted(kwargs)}']\n"
        "    return sample\n"
        "async def reward(args, sample):\n"
        "    return float(len(sample.metadata['trail']))\n"
    )
    parsed = resolve(
        [
            "--rollout-sample-hook-path", f"{sample_hooks}:first",
            "--rollout-sample-hook-path", f"{sample_hooks}:second",
        ]
    )  # fmt: skip
    assert parsed.rollout.rollout_sample_hook_path == [f"{sample_hooks}:first", f"{sample_hooks}:second"]
    cfg = make_config(
        rollout={
            "rollout_max_response_len": 4,
            "custom_rm_path": f"{sample_hooks}:reward",
            "rollout_sample_hook_path": parsed.rollout.rollout_sample_hook_path,
        },
        data={"rollout_batch_size": 1, "n_samples_per_prompt": 2},
    )
    ds = DataSource(records(engines, 2), n_samples_per_prompt=2)

    async def main() -> list[list[Any]]:
        async with RolloutContext(cfg, _router(engines.fast)) as ctx:
            with using_context(ctx):
                return await run_rollout(ctx, 5, ds)

    (group,) = run(main())
    for s in group:
        assert s.metadata["trail"] == ["first:5:False", "second:['evaluation', 'rollout_id']"]
        assert s.reward == 2.0  # the reward saw both hooks' work


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

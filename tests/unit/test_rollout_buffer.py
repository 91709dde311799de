"""slime's external rollout buffer: tether's rollout function speaks its protocol to a stand-in buffer
(aiohttp on 127.0.0.1, in this process); the four flags parse with slime's defaults, reach hooks as
`args.<name>`, and are refused where nothing would read them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.rollout import make_config
from support.rollout_buffer import NOT_READY, Answer, StandIn, group, ready, serving, trajectory
from test_slime_api_samples import _ChatTokenizer

from tether.config import resolve
from tether.rollout.config import BUFFER_ROLLOUT
from tether.rollout.hooks import rollout_buffer
from tether.rollout.hooks.calls import FlatArgs
from tether.rollout.hooks.rollout_buffer import RolloutBufferError, generate_rollout
from tether.rollout.rollout_fn import RolloutContext, using_context
from tether.rollout.routing.router import Router
from tether.rollout.sample import Sample, SampleStatus
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.convert import uses_slime_api
from tether.runtime.errors import ConfigError


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_buffer, "POLL_SECONDS", 0.01)


def rollouts(
    answers: list[Answer], *, calls: int = 1, **flags: Any
) -> tuple[StandIn, list[list[list[Sample]]], list[dict[str, float]]]:
    """`calls` rollouts by tether's buffer rollout function against a stand-in answering `answers`."""
    batch = flags.pop("rollout_batch_size", 2)
    stand_in = StandIn(answers)

    async def scenario() -> tuple[list[list[list[Sample]]], list[dict[str, float]]]:
        async with serving(stand_in):
            config = make_config(
                rollout={
                    "hf_checkpoint": "/models/tiny",
                    "rollout_function_path": BUFFER_ROLLOUT,
                    "rollout_buffer_url": stand_in.url,
                    "rollout_max_response_len": 64,
                    **flags,
                },
                data={"rollout_batch_size": batch, "n_samples_per_prompt": 2, "prompt_data": "p.jsonl"},
            )
            extra = slime_args(config, router_ip="127.0.0.1", router_port=4321)
            out, metrics = [], []
            async with RolloutContext(config, Router(), tokenizer=_ChatTokenizer(), args_extra=extra) as ctx:
                with using_context(ctx):
                    for rollout_id in range(calls):
                        out.append(await generate_rollout(ctx.args, rollout_id, None))  # type: ignore[arg-type]
                        metrics.append(dict(ctx.metrics))
            return out, metrics

    groups, metrics = asyncio.run(asyncio.wait_for(scenario(), 15))
    return stand_in, groups, metrics


# ----- the protocol -----
def test_a_batch_arrives_as_slimes_example_turns_trajectories_into_samples() -> None:
    meta = {"total_samples": 6, "avg_reward": 0.5, "finished_groups": []}
    first = ready(
        *group(7), trajectory(9, 0, reward=0.0), trajectory(9, 1, finish_reason="length"), meta=meta
    )
    stand_in, (groups,), (metrics,) = rollouts([NOT_READY, first], rollout_task_type="code")

    (start,) = stand_in.starts
    assert start == {
        "num_process": "100",
        "num_epoch": "3",
        "remote_engine_url": "http://127.0.0.1:4321",
        "remote_buffer_url": stand_in.url,
        "task_type": "code",
        "input_file": "p.jsonl",
        "num_repeat_per_sample": "2",
        "max_tokens": "64",
        "sampling_params": {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0},
        "tokenizer_path": "/models/tiny",
        "skip_instance_ids": [],
    }
    assert stand_in.fetches == 2
    assert [[s.metadata["instance_id"] for s in g] for g in groups] == [[7, 7], [9, 9]]
    tok = _ChatTokenizer()
    s = groups[1][1]
    # the whole chat rendered; the response from the assistant's first token, all of it trained
    assert tok.decode(s.tokens) == tok.apply_chat_template(trajectory(9, 1)["messages"])
    assert tok.decode(s.tokens[-s.response_length :]) == "a1</s>\n"
    assert s.loss_mask == [1] * s.response_length and s.rollout_log_probs == [0.0] * s.response_length
    assert (s.index, s.group_index, s.rollout_id, s.prompt) == (3, 1, 0, "u9-1")
    assert s.status is SampleStatus.TRUNCATED and groups[1][0].status is SampleStatus.COMPLETED
    assert [x.reward for g in groups for x in g] == [1.0, 1.0, 0.0, 1.0]
    assert s.metadata == {"finish_reason": "length", "instance_id": 9, "uid": "u9-1"}
    assert metrics["rollout/samples"] == 4 and metrics["rollout/reward_mean"] == 0.75
    assert metrics["rollout/no_filter/total_samples"] == 6 and metrics["rollout/no_filter/avg_reward"] == 0.5
    assert metrics["rollout/buffer/collected_ratio"] == 1.0


def test_the_buffer_is_started_once_per_run() -> None:
    stand_in, (_, second), _ = rollouts([ready(*group(7), *group(8))], calls=2)
    assert len(stand_in.starts) == 1
    assert [g[0].metadata["instance_id"] for g in second] == [7, 8]


def test_groups_past_the_batch_leave_out_the_oldest_as_slime_does() -> None:
    answer = ready(*group(1, timestamp=30.0), *group(2, timestamp=10.0), *group(3, timestamp=20.0))
    _, (groups,), (metrics,) = rollouts([answer])
    assert [g[0].metadata["instance_id"] for g in groups] == [1, 3]
    assert [s.index for g in groups for s in g] == [0, 1, 2, 3]
    assert metrics["rollout/buffer/dropped_groups"] == 1


def test_failed_requests_are_retried_up_to_the_flag() -> None:
    answers: list[Answer] = [500, 503, ready(*group(1), *group(2))]
    stand_in, (groups,), (metrics,) = rollouts(answers, fetch_trajectory_retry_times=3)
    assert len(groups) == 2 and stand_in.fetches == 3
    assert metrics["rollout/buffer/failed_requests"] == 2
    with pytest.raises(
        RolloutBufferError, match=r"failed 2 times \(--fetch-trajectory-retry-times=2\).*HTTP 503"
    ):
        rollouts([500, 503, ready(*group(1), *group(2))], fetch_trajectory_retry_times=2)
    # -1: without limit
    _, (groups,), _ = rollouts([500] * 5 + [ready(*group(1), *group(2))])
    assert len(groups) == 2


def test_an_unreachable_buffer_fails_after_the_retries() -> None:
    async def scenario() -> None:
        config = make_config(
            rollout={
                "hf_checkpoint": "/m",
                "rollout_function_path": BUFFER_ROLLOUT,
                "rollout_buffer_url": "http://127.0.0.1:9",  # discard port: nothing listens
                "fetch_trajectory_retry_times": 2,
            }
        )
        extra = slime_args(config, router_ip="127.0.0.1", router_port=1)
        async with RolloutContext(config, Router(), tokenizer=_ChatTokenizer(), args_extra=extra) as ctx:
            with using_context(ctx):
                await generate_rollout(ctx.args, 0, None)  # type: ignore[arg-type]

    with pytest.raises(RolloutBufferError, match=r"POST http://127.0.0.1:9/start_rollout failed 2 times"):
        asyncio.run(asyncio.wait_for(scenario(), 15))


def test_a_short_batch_is_taken_once_the_ratio_is_in_and_the_buffer_is_dry() -> None:
    answers: list[Answer] = [ready(*group(1)), NOT_READY, ready(*group(2)), NOT_READY, ready(*group(3))]
    # 2 of 4 groups suffice at 0.5: taken at the second not-ready answer
    stand_in, (groups,), (metrics,) = rollouts(answers, rollout_batch_size=4, min_batch_collection_ratio=0.5)
    assert len(groups) == 2 and stand_in.fetches == 4
    assert metrics["rollout/buffer/collected_ratio"] == 0.5
    # at 1 (slime's default) the rollout waits for the whole batch
    answers = [ready(*group(1)), NOT_READY, ready(*group(2)), NOT_READY, ready(*group(3), *group(4))]
    _, (groups,), _ = rollouts(answers, rollout_batch_size=4)
    assert len(groups) == 4
    # once retries run out, the ratio decides between a short batch and an error
    answers = [ready(*group(1), *group(2)), 500]
    _, (groups,), _ = rollouts(
        answers, rollout_batch_size=4, min_batch_collection_ratio=0.5, fetch_trajectory_retry_times=2
    )
    assert len(groups) == 2
    with pytest.raises(RolloutBufferError, match="with 2 of the 3 groups --min-batch-collection-ratio needs"):
        rollouts(
            answers, rollout_batch_size=4, min_batch_collection_ratio=0.75, fetch_trajectory_retry_times=2
        )


def _broken(field: str, value: Any) -> dict[str, Any]:
    record = trajectory(1, 0)
    if value is _DROP:
        del record[field]
    else:
        record[field] = value
    return record


_DROP = object()


@pytest.mark.parametrize(
    ("record", "field", "words"),
    [
        (_broken("reward", _DROP), "reward", "has no 'reward'"),
        (_broken("instance_id", _DROP), "instance_id", "has no 'instance_id'"),
        (_broken("reward", "high"), "reward", "reward='high' must be a finite number"),
        (_broken("messages", "hi"), "messages", "messages='hi' must be a non-empty list"),
        (_broken("messages", [{"content": "x"}]), "messages[0]", r"messages\[0\]=\{'content': 'x'\}"),
        (_broken("extra_info", "x"), "extra_info", "extra_info='x' must be an object"),
        (_broken("instance_id", [1]), "instance_id", r"instance_id=\[1\] must be a string or an integer"),
        (
            _broken("messages", [{"role": "user", "content": "q"}]),
            "messages",
            "hold no assistant token to train on",
        ),
        ("not a record", "trajectory", "trajectory 0 is 'not a record'"),
    ],
)
def test_a_malformed_trajectory_is_refused_naming_the_field(record: Any, field: str, words: str) -> None:
    with pytest.raises(RolloutBufferError, match=words) as err:
        rollouts([{"success": True, "data": {"data": [record], "meta_info": {}}}], rollout_batch_size=1)
    assert err.value.field == field
    assert BUFFER_ROLLOUT in str(err.value)


@pytest.mark.parametrize(
    ("answer", "field", "words"),
    [
        ({"data": []}, "success", "success=None must be true or false"),
        ({"success": True, "data": "x"}, "data", "data='x' must be a list of trajectories"),
        ([1], "success", r"is \[1\], not a JSON object"),
    ],
)
def test_a_malformed_answer_is_refused_naming_the_field(answer: Any, field: str, words: str) -> None:
    with pytest.raises(RolloutBufferError, match=words) as err:
        rollouts([answer])
    assert err.value.field == field


def test_the_rollout_function_is_tethers_own_not_slimes_api() -> None:
    # tether calls it with its own Samples and data source (not through the slime bridge)
    assert not uses_slime_api(generate_rollout)


def test_slimes_example_path_runs_tethers_client_of_the_same_protocol() -> None:
    # A slime launch script names the example's function; its samples of one group share an index,
    # which tether's Sample contract refuses, so the same protocol runs through tether's client
    # (tests/integration/test_slime_rollout_buffer_example.py: both build the same samples).
    from tether.config import SLIME_BUFFER_EXAMPLE

    argv = ["--rollout-function-path", SLIME_BUFFER_EXAMPLE, "--rollout-buffer-url", "http://127.0.0.1:8889"]
    assert resolve([*argv, "--hf-checkpoint", "m"]).rollout.rollout_function_path == BUFFER_ROLLOUT
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        resolve(argv)


# ----- the flags -----
FLAGS = {
    "--rollout-buffer-url": ("http://127.0.0.1:8889", "rollout_buffer_url"),
    "--fetch-trajectory-retry-times": ("3", "fetch_trajectory_retry_times"),
    "--min-batch-collection-ratio": ("0.5", "min_batch_collection_ratio"),
    "--rollout-task-type": ("code", "rollout_task_type"),
}


def test_the_flags_have_slimes_defaults_and_reach_hooks_as_args() -> None:
    cfg = resolve([])
    assert (
        cfg.rollout.rollout_buffer_url,
        cfg.rollout.fetch_trajectory_retry_times,
        cfg.rollout.min_batch_collection_ratio,
        cfg.rollout.rollout_task_type,
    ) == (None, -1, 1.0, "math")
    argv = ["--rollout-function-path", "my_hooks.rollout:generate"]
    for flag, (value, _) in FLAGS.items():
        argv += [flag, value]
    cfg = resolve(argv)
    args = FlatArgs(cfg, extra=slime_args(cfg, router_ip="127.0.0.1", router_port=1))
    assert (
        args.rollout_buffer_url,
        args.fetch_trajectory_retry_times,
        args.min_batch_collection_ratio,
        args.rollout_task_type,
    ) == ("http://127.0.0.1:8889", 3, 0.5, "code")
    cfg = resolve(
        [
            "--rollout-function-path",
            BUFFER_ROLLOUT,
            "--rollout-buffer-url",
            "http://h:1",
            "--hf-checkpoint",
            "/m",
        ]
    )
    assert cfg.rollout.rollout_buffer_url == "http://h:1"


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_a_flag_the_default_rollout_would_not_read_is_refused(flag: str) -> None:
    value, name = FLAGS[flag]
    with pytest.raises(ConfigError, match=f"default rollout does not.*args.{name}") as err:
        resolve([flag, value])
    assert err.value.key == flag


@pytest.mark.parametrize(
    ("argv", "key", "words"),
    [
        (["--hf-checkpoint", "/m"], "--rollout-buffer-url", "must be set for --rollout-function-path"),
        (["--rollout-buffer-url", "http://h:1"], "--hf-checkpoint", "its tokenizer"),
        (
            ["--hf-checkpoint", "/m", "--rollout-buffer-url", "h:1"],
            "--rollout-buffer-url",
            "http:// or https://",
        ),
        (
            [
                "--hf-checkpoint",
                "/m",
                "--rollout-buffer-url",
                "http://h:1",
                "--fetch-trajectory-retry-times",
                "0",
            ],
            "--fetch-trajectory-retry-times",
            "-1 .* or at least 1",
        ),
        (
            ["--hf-checkpoint", "/m", "--rollout-buffer-url", "http://h:1", "--loop", "fully-async"],
            "--loop",
            "calls no --rollout-function-path",
        ),
        (
            ["--hf-checkpoint", "/m", "--rollout-buffer-url", "http://h:1", "--use-tis"],
            "--use-tis",
            "carry none",
        ),
    ],
)
def test_the_buffer_rollout_function_refuses_what_it_cannot_do(argv: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        resolve(["--rollout-function-path", BUFFER_ROLLOUT, *argv])
    assert err.value.key == key


def test_a_ratio_outside_0_to_1_is_refused() -> None:
    for value in ("0", "1.5"):
        with pytest.raises(ConfigError) as err:
            resolve(["--rollout-function-path", "m.f", "--min-batch-collection-ratio", value])
        assert err.value.key == "--min-batch-collection-ratio"

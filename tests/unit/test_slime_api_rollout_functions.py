"""What slime-API rollout functions return, as tether takes it (both shapes, flat or nested
groups, evaluation dicts), and `run()` from the thread tether runs a synchronous one in."""

from __future__ import annotations

import asyncio

import pytest
from support.rollout import make_config

from tether.rollout.hooks.calls import HookError
from tether.rollout.rollout_fn import RolloutContext, using_context
from tether.rollout.routing.router import Router
from tether.rollout.sample import Sample, SampleStatus
from tether.rollout.slime_api.bridge import eval_metrics, groups_from_slime
from tether.rollout.slime_api.rollout.base_types import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    call_rollout_fn,
)
from tether.rollout.slime_api.utils.async_utils import run
from tether.rollout.slime_api.utils.types import Sample as SlimeSample


def _done(index: int, group: int, reward: float = 1.0) -> SlimeSample:
    s = SlimeSample(index=index, group_index=group, tokens=[1, 2], prompt="p")
    s.append_response_tokens(
        None, tokens=[3], log_probs=[-0.5], meta_info={"finish_reason": {"type": "stop"}}, text="x"
    )
    s.reward = reward
    return s


def test_groups_nested_flat_and_fanned_out() -> None:
    nested = [[_done(0, 0), _done(1, 0)], [_done(2, 1), _done(3, 1)]]
    groups = groups_from_slime("my.rollout", nested, rollout_id=5)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert all(
        isinstance(s, Sample) and s.rollout_id == 5 and s.status is SampleStatus.COMPLETED
        for g in groups
        for s in g
    )
    flat = [_done(0, 0), _done(2, 1), _done(1, 0)]
    assert [[s.index for s in g] for g in groups_from_slime("my.rollout", flat, 0)] == [[0, 1], [2]]
    fanned = [[[_done(0, 0), _done(1, 0)], [_done(2, 0)]]]  # a generate that returned lists
    assert [len(g) for g in groups_from_slime("my.rollout", fanned, 0)] == [3]


@pytest.mark.parametrize(
    ("samples", "message", "field"),
    [
        ([], "expected a non-empty list of sample groups", None),
        ([[_done(0, 0)], "x"], "group 1 is str", None),
        ([SlimeSample(index=0)], "no group_index", "group_index"),
        ([[_done(0, 0), _done(1, 1)]], "group_index", "group_index"),
    ],
)
def test_bad_rollout_output_names_the_function(samples: list, message: str, field: str | None) -> None:
    with pytest.raises(HookError, match=message) as err:
        groups_from_slime("my.rollout", samples, 0)
    assert err.value.path == "my.rollout" and err.value.field == field


def test_an_unscored_sample_is_refused_naming_reward() -> None:
    s = _done(0, 0)
    s.reward = None
    with pytest.raises(HookError, match=r"group 0: sample 0: reward=None") as err:
        groups_from_slime("my.rollout", [[s]], 0)
    assert err.value.field == "reward"


def test_both_return_shapes_and_eval_metrics() -> None:
    def old_style(args: object, rollout_id: int, data_source: object, evaluation: bool = False) -> object:
        return {"gsm": {"rewards": [1, 0]}} if evaluation else [[_done(0, 0)]]

    train = call_rollout_fn(old_style, None, 0, None, evaluation=False)
    assert isinstance(train, RolloutFnTrainOutput) and len(train.samples) == 1
    evaluated = call_rollout_fn(old_style, None, 0, None, evaluation=True)
    assert isinstance(evaluated, RolloutFnEvalOutput)
    assert eval_metrics("f", evaluated) == {"eval/gsm/samples": 2.0, "eval/gsm/reward_mean": 0.5}
    new = RolloutFnEvalOutput(data={"m": {"rewards": [1.0], "truncated": [True]}}, metrics={"x": 2})
    assert eval_metrics("f", (new, [])) == {
        "eval/m/samples": 1.0,
        "eval/m/reward_mean": 1.0,
        "eval/m/truncated_ratio": 1.0,
        "x": 2.0,
    }
    with pytest.raises(HookError, match="training output"):
        eval_metrics("f", RolloutFnTrainOutput(samples=[]))
    with pytest.raises(HookError, match="rewards must be numbers") as err:
        eval_metrics("f", {"m": {"rewards": ["high"]}})
    assert err.value.field == "rewards"


def test_run_from_a_thread_runs_on_the_rollouts_loop() -> None:
    async def scenario() -> None:
        async with RolloutContext(make_config(), Router()) as ctx:
            loop = asyncio.get_running_loop()

            async def where() -> asyncio.AbstractEventLoop:
                return asyncio.get_running_loop()

            with using_context(ctx):
                assert await asyncio.to_thread(lambda: run(where())) is loop
                with pytest.raises(RuntimeError, match="cannot be called on the rollout's own event loop"):
                    run(where())

    asyncio.run(scenario())
    assert run(asyncio.sleep(0, result=7)) == 7  # outside a rollout: a loop of its own

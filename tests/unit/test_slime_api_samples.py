"""slime's Sample on tether: conversion both ways, and the hooks that take and return it
(generate, reward, dynamic filter, buffer filter), with errors naming the hook and the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.rollout import make_config

from tether.rollout.data.source import DataSource, PromptRecord
from tether.rollout.hooks.calls import (
    FlatArgs,
    HookError,
    buffer_filter,
    call_filter,
    call_generate_hook,
    load_function,
)
from tether.rollout.rewards import scoring as tether_rewards
from tether.rollout.rewards.scoring import RewardModel
from tether.rollout.sample import Sample, SampleStatus, validate_sample
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.convert import (
    SLIME_ATTRS,
    ConversionError,
    from_slime,
    to_slime,
    uses_slime_api,
)
from tether.rollout.slime_api.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from tether.rollout.slime_api.rollout.rm_hub import async_rm
from tether.rollout.slime_api.rollout.rm_hub.math_utils import grade_answer_verl
from tether.rollout.slime_api.utils.mask_utils import MultiTurnLossMaskGenerator, get_response_lengths
from tether.rollout.slime_api.utils.types import Sample as SlimeSample


@pytest.fixture(autouse=True)
def slime_finder() -> Iterator[None]:
    """Each test starts and ends without the import hook (loading a hook installs it)."""
    finder.uninstall()
    yield
    finder.uninstall()


def _tether_sample() -> Sample:
    s = Sample(index=3, group_index=1, rollout_id=0, tokens=[5, 6, 7], label="7", session_id="s1")
    s.extend_response([8, 9], "ab", log_probs=[-0.5, -0.25])
    s.extend_response([10], "c")  # a tool's token: context only
    s.status, s.reward = SampleStatus.COMPLETED, 1.0
    s.weight_versions.append("2")
    s.metadata.update({"source": "gsm", SLIME_ATTRS: {"tool_calls": 1}})
    return s


def _slime_sample() -> SlimeSample:
    s = SlimeSample(index=0, group_index=0, tokens=[1, 2, 3], prompt="p")
    meta = {"finish_reason": {"type": "length"}, "weight_version": "4"}
    s.append_response_tokens(None, tokens=[4, 5], log_probs=[-0.1, -0.2], trainable=True, text="xy")
    s.append_response_tokens(None, tokens=[6], trainable=False, text="!")
    s.append_response_tokens(None, tokens=[7], log_probs=[-0.3], meta_info=meta, text="z")
    s.reward = 1  # an int, as slime's math reward gives
    return s


def test_tether_to_slime_keeps_every_shared_field_and_the_extras() -> None:
    s = _tether_sample()
    out = to_slime(s)
    assert isinstance(out, SlimeSample)
    assert (out.index, out.group_index, out.rollout_id, out.session_id, out.label) == (3, 1, 0, "s1", "7")
    assert out.tokens == [5, 6, 7, 8, 9, 10] and out.response == "abc" and out.response_length == 3
    assert out.loss_mask == [1, 1, 0] and out.rollout_log_probs == [-0.5, -0.25, 0.0]
    assert out.status is SlimeSample.Status.COMPLETED and out.reward == 1.0 and out.weight_versions == ["2"]
    assert out.metadata == {"source": "gsm"} and out.tool_calls == 1  # type: ignore[attr-defined]
    assert out.multimodal_inputs is None and out.get_reward_value(FlatArgs(make_config())) == 1.0
    assert out.effective_response_length == 2
    out.tokens.append(99)
    assert s.tokens[-1] == 10  # a copy: the hook cannot change tether's sample behind its back


def test_slime_to_tether_round_trip_and_contract() -> None:
    s = _slime_sample()
    assert s.status is SlimeSample.Status.TRUNCATED and s.weight_versions == ["4"]
    assert s.loss_mask == [1, 1, 0, 1] and s.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    s.tool_calls = 2  # type: ignore[attr-defined]
    back = from_slime(s)
    assert isinstance(back, Sample) and back.status is SampleStatus.TRUNCATED and back.reward == 1.0
    assert back.tokens == [1, 2, 3, 4, 5, 6, 7] and back.response_length == 4 and back.response == "xy!z"
    assert back.metadata[SLIME_ATTRS] == {"tool_calls": 2}
    back.rollout_id = 0
    assert validate_sample(back) == 3
    again = to_slime(back)
    assert again.tool_calls == 2 and again.to_dict()["status"] == "truncated"  # type: ignore[attr-defined]
    assert SlimeSample.from_dict(again.to_dict()).tool_calls == 2  # type: ignore[attr-defined]


def test_slime_rules_at_the_boundary() -> None:
    s = SlimeSample(tokens=[1, 2, 3], response_length=2, rollout_log_probs=[-0.1, -0.2])
    assert from_slime(s).loss_mask == [1, 1]  # slime: no loss mask means every response token trains
    s.loss_mask = [0, 1]
    assert from_slime(s).rollout_log_probs == [0.0, -0.2]  # nothing trains under a 0: tether wants 0 there
    s.remove_sample = True  # slime: stays in the batch, trains nothing
    removed = from_slime(s)
    assert removed.loss_mask == [0, 0] and removed.rollout_log_probs == [0.0, -0.2]
    assert to_slime(removed).remove_sample is True
    assert to_slime(from_slime(SlimeSample(tokens=[1, 2], response_length=1))).remove_sample is False


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("multimodal_inputs", {"images": ["x.png"]}, "text only"),
        ("rollout_routed_experts", [[1, 2]], r"is not \[rows, layers, topk\] ints"),
        ("teacher_log_probs", "x", "must be a list of floats"),  # carried when it is floats
        ("tokens", [1, "2"], "must be an int"),
        ("status", "done", "is not one of"),
        ("metadata", ["not", "a", "dict"], "must be a dict"),
        ("handle", object(), "cannot be carried"),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    s = SlimeSample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_log_probs=[-0.1])
    setattr(s, field, value)
    with pytest.raises(ConversionError, match=message) as err:
        from_slime(s)
    assert err.value.field in (field, "tokens[1]")


def test_routed_experts_convert_both_ways() -> None:
    import numpy as np
    import torch

    experts = torch.tensor([[[0, 3]], [[2, 1]]], dtype=torch.int64)  # [len(tokens)-1, layers, topk]
    s = SlimeSample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.1])
    s.rollout_routed_experts = experts
    ours = from_slime(s)
    assert ours.rollout_routed_experts is not None
    assert ours.rollout_routed_experts.array().tolist() == experts.tolist()
    back = to_slime(ours).rollout_routed_experts
    assert isinstance(back, np.ndarray) and back.dtype == np.int32 and back.tolist() == experts.tolist()
    s.rollout_routed_experts = [[[0, 3]], [[2, 1]]]  # nested lists, as a hook may build them
    assert from_slime(s).rollout_routed_experts == ours.rollout_routed_experts
    assert to_slime(from_slime(SlimeSample(tokens=[1, 2], response_length=1))).rollout_routed_experts is None


def _hook_file(tmp_path: Path, body: str, name: str = "slime_hook.py") -> Path:
    path = tmp_path / name
    path.write_text("from slime.utils.types import Sample\n" + body)
    return path


def test_a_generate_hook_in_slime_api_gets_and_returns_slime_samples(tmp_path: Path) -> None:
    hook = _hook_file(
        tmp_path,
        "async def generate(args, sample, sampling_params):\n"
        "    assert isinstance(sample, Sample) and sample.status == Sample.Status.PENDING\n"
        "    sampling_params['max_new_tokens'] -= 1  # slime's hooks change their own copy\n"
        "    sample.append_response_tokens(args, tokens=[9], log_probs=[-0.5], meta_info="
        "{'finish_reason': {'type': 'stop'}, 'weight_version': '1'}, text='z')\n"
        "    sample.steps = 1\n"
        "    return sample\n"
        "async def broken(args, sample, sampling_params):\n"
        "    sample.append_response_tokens(args, tokens=[9], log_probs=[-0.5], text='z')\n"
        "    sample.status = Sample.Status.COMPLETED\n"
        "    sample.rollout_log_probs = [0.5]\n"
        "    return [sample]\n",
    )
    path = f"{hook}:generate"
    fn = load_function(path, "--custom-generate-function-path")
    assert uses_slime_api(fn) and finder.installed()
    # tether's own hooks stay in tether's API, though their modules use the slime API's glue
    assert not uses_slime_api(tether_rewards.check_reward_nonzero_std)
    assert not uses_slime_api(load_function("tether.rollout.hooks.default_rollout.generate_rollout"))
    params = {"max_new_tokens": 4}
    pending = Sample(index=0, group_index=0, rollout_id=0, tokens=[1, 2])
    [out] = asyncio.run(call_generate_hook(fn, path, make_config(), pending, params))
    assert isinstance(out, Sample) and out.status is SampleStatus.COMPLETED and out.tokens == [1, 2, 9]
    assert out.weight_versions == ["1"] and out.metadata[SLIME_ATTRS] == {"steps": 1}
    assert params == {"max_new_tokens": 4}
    bad_path = f"{hook}:broken"
    broken = load_function(bad_path, "--custom-generate-function-path")
    with pytest.raises(HookError, match=r"slime_hook\.py:broken.*rollout_log_probs\[0\]") as err:
        asyncio.run(call_generate_hook(broken, bad_path, make_config(), pending, params))
    assert err.value.path == bad_path and err.value.field == "rollout_log_probs[0]"


def test_rewards_in_slime_api_single_and_group(tmp_path: Path) -> None:
    hook = _hook_file(
        tmp_path,
        "async def reward_func(args, sample, **kwargs):\n"
        "    sample.metadata['seen'] = True\n"
        "    return sample.response == sample.label  # a bool, as slime's hooks may return\n"
        "async def group_reward(args, samples, **kwargs):\n"
        "    return [float(i) for i, _ in enumerate(samples)]\n",
    )
    samples = [_tether_sample(), _tether_sample(), _tether_sample()]
    samples[0].reward = samples[1].reward = None
    samples[1].label = "abc"
    samples[2].reward = 0.5  # given during generation: it stands, as in slime's generate_and_rm
    model = RewardModel(make_config(rollout={"custom_rm_path": f"{hook}:reward_func"}).rollout)
    asyncio.run(model.score_group(samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 0.5]
    assert samples[0].metadata["seen"] and samples[1].metadata["seen"] and "seen" not in samples[2].metadata
    samples = samples[:2]
    assert samples[0].metadata[SLIME_ATTRS] == {"tool_calls": 1}
    group = RewardModel(
        make_config(rollout={"custom_rm_path": f"{hook}:group_reward", "group_rm": True}).rollout
    )
    asyncio.run(group.score_group(samples))
    assert [s.reward for s in samples] == [0.0, 1.0]


def test_slime_filters_and_keep_when_insufficient(tmp_path: Path) -> None:
    args = FlatArgs(make_config())
    same, mixed = (
        [to_slime(_tether_sample()) for _ in range(2)],
        [to_slime(_tether_sample()) for _ in range(2)],
    )
    mixed[1].reward = 0.0
    assert check_reward_nonzero_std(args, same).keep is False
    assert check_reward_nonzero_std(args, same).reason == "zero_std_1.0"
    assert check_reward_nonzero_std(args, mixed).keep is True
    assert check_reward_nonzero_std(args, same[:1]).keep is False  # one reward has no spread (as slime)
    hook = _hook_file(
        tmp_path,
        "from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback\n"
        "def keep(args, samples, **kwargs):\n"
        "    assert all(isinstance(s, Sample) for s in samples)\n"
        "    return check_reward_nonzero_std_with_fallback(args, samples, **kwargs)\n",
    )
    path = f"{hook}:keep"
    fn = load_function(path, "--dynamic-sampling-filter-path")
    group = [_tether_sample(), _tether_sample()]
    assert call_filter(fn, path, args, group) == (False, "zero_std_1.0")
    assert call_filter(fn, path, args, group, insufficient=True) == (True, None)
    assert check_reward_nonzero_std_with_fallback(args, same).keep_when_insufficient


def _buffered_source() -> DataSource:
    source = DataSource([PromptRecord(prompt="p", tokens=[1, 2])], n_samples_per_prompt=1)
    for i in range(3):
        source.add_samples([[Sample(index=10 + i, group_index=10 + i, tokens=[1, 2])]])
    return source


def test_buffer_filter_in_slime_api_takes_from_the_buffer(tmp_path: Path) -> None:
    hook = _hook_file(
        tmp_path,
        "def newest_first(args, rollout_id, buffer, num_samples):\n"
        "    assert rollout_id is None and isinstance(buffer[0][0], Sample)\n"
        "    taken = buffer[::-1][:num_samples]\n"
        "    buffer[:] = [g for g in buffer if all(g is not t for t in taken)]\n"
        "    return taken\n"
        "def greedy(args, rollout_id, buffer, num_samples):\n"
        "    return buffer[:1]\n",
    )
    path = f"{hook}:newest_first"
    source = _buffered_source()
    source.buffer_filter = buffer_filter(load_function(path), path, make_config())
    groups = source.get_samples(2)
    assert [g[0].index for g in groups] == [12, 11] and all(isinstance(g[0], Sample) for g in groups)
    assert source.buffer_size == 1
    assert [g[0].index for g in source.get_samples(2)] == [10, 0]  # the buffer, then a fresh prompt
    greedy = f"{hook}:greedy"
    source = _buffered_source()
    source.buffer_filter = buffer_filter(load_function(greedy), greedy, make_config())
    with pytest.raises(HookError, match=r"greedy.*left it in the buffer"):
        source.get_samples(2)


def test_async_rm_by_slime_names_on_tethers_verifiers() -> None:
    config = make_config(rollout={"rm_type": "math"})
    args = FlatArgs(config, extra=slime_args(config, router_ip="127.0.0.1", router_port=1))
    s = SlimeSample(response=r"so \boxed{42}", label="42")
    assert asyncio.run(async_rm(args, s)) == 1
    s.metadata["rm_type"] = "boxed_exact_match"
    assert asyncio.run(async_rm(args, s)) == 1.0
    s.metadata["rm_type"] = "dapo"
    assert asyncio.run(async_rm(args, s)) == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert grade_answer_verl(r"x \boxed{\frac{1}{2}}", "0.5") and not grade_answer_verl("0.5", "0.5")


def test_hook_args_answer_slime_names() -> None:
    config = make_config(data={"rollout_batch_size": 3})
    args = FlatArgs(config, extra=slime_args(config, router_ip="127.0.0.1", router_port=4321))
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 4321)
    assert args.over_sampling_batch_size == 3 and args.rollout_global_dataset is True
    assert args.rollout_batch_size == 3 and args.router_policy == "power_of_two"
    assert not args.use_rollout_routing_replay and args.ci_test is False
    assert "sglang_router_port" in dir(args)


class _ChatTokenizer:
    """One token per character; the tiny model's chat template, rendered by hand."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        text = "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages)
        return text + ("<s>assistant\n" if kwargs.get("add_generation_prompt") else "")


def test_multi_turn_loss_mask_trains_only_the_assistant() -> None:
    tok = _ChatTokenizer()
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5", "step_loss_mask": 0},
        {"role": "assistant", "content": "ok"},
    ]
    gen = MultiTurnLossMaskGenerator(tok, tokenizer_type="qwen3")
    ids, mask = gen.get_loss_mask(messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages)
    assert gen.get_text_from_loss_mask(ids, mask) == ["call</s>\n", "ok</s>\n"]
    assert get_response_lengths([[0, 1, 0], [0, 0]]) == [2, 0]
    with pytest.raises(ValueError, match="tokenizer_type"):
        MultiTurnLossMaskGenerator(tok, tokenizer_type="llama9")

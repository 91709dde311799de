"""slime's reward types (rm_hub) and data flags, with slime's meaning; expected values from slime's rules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from support.rollout import make_config

from tether.config import resolve
from tether.rollout.data.source import DataError, load_prompts
from tether.rollout.hooks.calls import FlatArgs, HookError
from tether.rollout.rewards.rules import (
    boxed_content,
    dapo_score,
    deepscaler_score,
    f1_score,
    gpqa_score,
    math_score,
    rule_reward,
)
from tether.rollout.rewards.scoring import RewardModel
from tether.rollout.rewards.types import missing_requirement
from tether.rollout.sample import Sample
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.rollout.rm_hub import async_rm
from tether.rollout.slime_api.utils.types import Sample as SlimeSample
from tether.runtime.errors import ConfigError
from tether.train.rank.batching import build_train_batch, shard_for_data_parallel


def test_math_grades_the_last_boxed_answer() -> None:
    assert math_score(r"so \boxed{42}", "42") == 1
    assert math_score(r"x \boxed{\frac{1}{2}}", "0.5") == 1  # Hendrycks: 0.5 is \frac{1}{2}
    assert math_score(r"\boxed{\dfrac{1}{2}}", r"\boxed{\frac12}") == 1
    assert math_score(r"\boxed{\sqrt{8}}", r"2\sqrt{2}") == 1  # equal under sympy
    assert math_score(r"\boxed{(1, 2)}", "(1,2)") == 1
    assert math_score(r"\boxed{43}", "42") == 0
    assert math_score(r"\boxed{3/6}", r"\frac{1}{2}") == 0  # unreduced fractions are not simplified
    assert math_score("the answer is 42", "42") == 0  # no \boxed{}: no answer
    assert math_score(r"\boxed{42", "42") == 0  # unclosed
    assert math_score(r"\boxed{0}", 0) == 0  # an empty (falsy) label scores 0, as in slime


def test_deepscaler_grades_after_the_reasoning() -> None:
    assert deepscaler_score(r"<think>maybe \boxed{4}</think> so \boxed{3}", "3") == 1
    assert deepscaler_score(r"###Response the result is \boxed{3}", r"\boxed{3}") == 1
    assert deepscaler_score(r"<think>x</think> \boxed{4}", "3") == 0
    assert deepscaler_score(r"\boxed{3}", "3") == 0  # neither </think> nor ###Response
    assert deepscaler_score("<think>x</think> 3", "3") == 0  # no boxed answer
    assert deepscaler_score(r"</think>\boxed{3}", "") == 0


def test_dapo_scores_the_answer_line_plus_or_minus_one() -> None:
    assert dapo_score("work...\nAnswer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert dapo_score("Answer: $1,000$ dollars", 1000) == {"score": 1.0, "acc": True, "pred": "1000"}
    assert dapo_score("answer: 41", "42") == {"score": -1.0, "acc": False, "pred": "41"}
    assert dapo_score("no answer line", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert dapo_score("Answer: 42" + "x" * 400, "42")["score"] == -1.0  # only the last 300 chars count
    with pytest.raises(ValueError, match="integer label"):
        dapo_score("Answer: x", "x")


def test_f1_is_token_overlap() -> None:
    assert f1_score("The cat sat.", "the cat sat") == 1.0
    assert f1_score("cat sat on mat", "the cat sat") == pytest.approx(2 / 3)
    assert f1_score("dog", "cat") == 0
    assert f1_score("yes", "no") == 0 and f1_score("Yes!", "yes") == 1.0


def test_gpqa_reads_the_option_letter() -> None:
    assert gpqa_score("The answer is B", "B", {}) == 1.0
    assert gpqa_score("<think>answer is B?</think> The answer is C", "B", {}) == 0.0
    assert gpqa_score("Final answer: B", 1, {"choices": ["Paris", "London"]}) == 1.0  # index label
    assert gpqa_score("I'd say London.", "London", {"choices": ["Paris", "London"]}) == 1.0  # option text
    assert gpqa_score("I'd say Paris.", "London", {"choices": ["Paris", "London"]}) == 0.0
    assert gpqa_score("The answer is A", "x", {"correct_letter": "a"}) == 1.0
    assert gpqa_score("", "B", {}) == 0.0 and gpqa_score("no idea", "B", {}) == 0.0


def test_boxed_variants_random_and_ifbench() -> None:
    assert boxed_content(r"a \boxed{x{y}} b \boxed{z}") == "z"
    assert rule_reward("boxed_f1", r"so \boxed{the cat}", "cat") == 1.0
    assert rule_reward("boxed_f1", "the cat", "cat") == 0  # no \boxed{}: scored as ""
    assert rule_reward("boxed_dapo", r"\boxed{Answer: 7}", "7")["acc"] is True
    assert {rule_reward("random", "", None) for _ in range(64)} == {0, 1}
    assert missing_requirement("ifbench") is not None  # IFBench's evaluation_lib is not installed here
    with pytest.raises(ModuleNotFoundError, match="evaluation_lib"):
        rule_reward("ifbench", "text", None, {"instruction_id_list": ["a"]})


def test_rm_type_flag_takes_every_slime_type_and_refuses_the_rest() -> None:
    for kind in ("math", "deepscaler", "dapo", "f1", "gpqa", "random", "exact_match", "boxed_math"):
        assert resolve(["--rm-type", kind]).rollout.rm_type == kind
    with pytest.raises(ConfigError, match=r"--rm-type.*'ifbench'.*evaluation_lib"):
        resolve(["--rm-type", "ifbench"])
    with pytest.raises(ConfigError, match=r"--rm-type.*'boxed_nope'.*not a reward type"):
        resolve(["--rm-type", "boxed_nope"])


def _score(rm_type: str | None, sample: Sample) -> Any:
    async def go() -> Any:
        async with RewardModel(make_config(rollout={"rm_type": rm_type}).rollout) as model:
            await model.score_group([sample])
        return sample.reward

    return asyncio.run(go())


def test_reward_model_scores_by_slime_rules_and_the_samples_rm_type() -> None:
    assert _score("deepscaler", Sample(index=0, response=r"</think>\boxed{5}", label="5")) == 1.0
    assert _score("dapo", Sample(index=0, response="Answer: 5", label="6"))["score"] == -1.0
    # the sample's metadata rm_type wins over --rm-type, and works without one (slime's order)
    s = Sample(index=0, response="cat", label="cat", metadata={"rm_type": "f1"})
    assert _score("math", s) == 1.0
    s = Sample(index=1, response=r"\boxed{2}", label="2", metadata={"rm_type": "math"})
    assert _score(None, s) == 1.0
    with pytest.raises(HookError, match=r"rm_type.*'nope'"):
        _score(None, Sample(index=2, response="x", metadata={"rm_type": "nope"}))


def test_slime_rm_hub_async_rm_reaches_every_scorer() -> None:
    config = make_config(rollout={"rm_type": "deepscaler"})
    args = FlatArgs(config, extra=slime_args(config, router_ip="127.0.0.1", router_port=1))
    s = SlimeSample(response=r"<think>hm</think>\boxed{7}", label="7")
    assert asyncio.run(async_rm(args, s)) == 1
    s.metadata["rm_type"] = "gpqa"
    s.response, s.label = "The answer is C", "C"
    assert asyncio.run(async_rm(args, s)) == 1.0
    s.metadata["rm_type"] = "unknown"
    with pytest.raises(NotImplementedError, match="not a reward tether knows"):
        asyncio.run(async_rm(args, s))


class TemplateRecorder:
    """A tokenizer that records what the chat template was given."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "".join(m["content"] for m in conversation)


def test_tools_and_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "add"}}]
    path = tmp_path / "p.jsonl"
    rows = [{"q": "hi", "tools": tools}, {"q": "yo", "tools": json.dumps(tools)}, {"q": "no tools"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve(["--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert cfg.data.tool_key == "tools"  # slime's default
    tok = TemplateRecorder()
    records, _ = load_prompts(
        path, tok, input_key="q", label_key=None, metadata_key="m", apply_chat_template=True,
        max_prompt_len=None, tool_key=cfg.data.tool_key,
        apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
    )  # fmt: skip
    assert [c["tools"] for c in tok.calls] == [tools, tools, None]
    assert all(c["enable_thinking"] is False for c in tok.calls)
    assert records[0].metadata["tools"] == tools and "tools" not in records[2].metadata
    path.write_text(json.dumps({"q": "x", "tools": {"a": 1}}) + "\n")
    with pytest.raises(DataError, match=r"'tools' \(--tool-key\) must be a list"):
        load_prompts(path, tok, input_key="q", label_key=None, metadata_key="m", apply_chat_template=True,
                     max_prompt_len=None, tool_key="tools")  # fmt: skip


def test_data_flags_parse_or_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--apply-chat-template-kwargs.*JSON object"):
        resolve(["--apply-chat-template-kwargs", "[1]"])
    with pytest.raises(ConfigError, match=r"--start-rollout-id.*3.*checkpoint"):
        resolve(["--start-rollout-id", "3"])
    with pytest.raises(ConfigError, match=r"--loss-mask-type.*'llama'"):
        resolve(["--loss-mask-type", "llama"])
    cfg = resolve(["--loss-mask-type", "qwen3", "--tool-key", "functions"])
    args = FlatArgs(cfg, extra=slime_args(cfg, router_ip=None, router_port=None))
    assert (args.loss_mask_type, args.tool_key, args.apply_chat_template_kwargs) == ("qwen3", "functions", {})
    assert resolve([]).data.balance_data is False and resolve(["--balance-data"]).data.balance_data is True


def test_balance_data_balances_tokens_default_is_round_robin() -> None:
    lengths = [100, 90, 10, 5, 80, 7]
    samples = [Sample(index=i, tokens=[1] * (n - 1) + [2], response_length=1) for i, n in enumerate(lengths)]
    batch = build_train_batch(samples, rewards=[0.0] * 6)
    strided = shard_for_data_parallel(batch, 2, balance=False)
    assert [s.total_lengths.tolist() for s in strided] == [[100, 10, 80], [90, 5, 7]]  # 190 vs 102
    balanced = shard_for_data_parallel(batch, 2, balance=True)
    sums = sorted(int(s.total_lengths.sum()) for s in balanced)
    assert sums == [117, 175] and all(s.num_samples == 3 for s in balanced)  # greedy LPT: 58 apart, not 88


def test_tools_read_from_parquet_arrive_as_a_list() -> None:
    """Parquet readers give a record's tools as a numpy array; the source takes it as the list."""
    import numpy as np

    from tether.rollout.data.source import record_tools

    tools = np.array([{"type": "function", "function": {"name": "add"}}], dtype=object)
    assert record_tools({"tools": tools}, "tools", "f.parquet:1") == [
        {"type": "function", "function": {"name": "add"}}
    ]

"""Rollout pieces that need no engine: config checks, rewards, hooks, data source, router choice, dumps."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from support.rollout import make_config

from tether.rollout.config import DataConfig, RolloutConfig
from tether.rollout.data.source import DataError, DataSource, PromptRecord, load_prompts
from tether.rollout.debug_dump import DebugDumpError, load_rollout, save_rollout
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.fully_async import weight_lag
from tether.rollout.hooks.calls import FlatArgs, HookError, check_hook_samples, load_function
from tether.rollout.rewards.scoring import check_reward_nonzero_std, exact_match, extract_answer, math_reward
from tether.rollout.rollout_fn import append_segment, reset_to_prompt
from tether.rollout.routing.router import Router
from tether.rollout.sample import Sample, SampleStatus
from tether.runtime.errors import ConfigError


class CharTokenizer:
    """One token per character (ids = code points); enough to test the data source."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: object) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


def test_config_checks_name_flag_and_value() -> None:
    with pytest.raises(ConfigError, match="--rm-url"):
        RolloutConfig(rm_type="remote_rm")
    with pytest.raises(ConfigError, match="--mask-offpolicy-in-partial-rollout"):
        RolloutConfig(mask_offpolicy_in_partial_rollout=True)
    with pytest.raises(ConfigError, match="--num-steps-per-rollout"):
        DataConfig(rollout_batch_size=3, n_samples_per_prompt=1, num_steps_per_rollout=2)
    with pytest.raises(ConfigError, match="--max-tokens-per-gpu"):
        DataConfig(use_dynamic_batch_size=True)
    with pytest.raises(msgspec.ValidationError, match="rollout_max_response_len"):
        msgspec.convert({"rollout_max_response_len": 0}, RolloutConfig)
    assert DataConfig(eval_prompt_data=["aime", "a.jsonl", "gsm", "b.jsonl"]).eval_datasets() == [
        ("aime", "a.jsonl"),
        ("gsm", "b.jsonl"),
    ]
    assert (
        DataConfig(
            rollout_batch_size=4, n_samples_per_prompt=2, num_steps_per_rollout=2
        ).resolved_global_batch_size
        == 4
    )


def test_math_reward_normalises_boxed_and_numbers() -> None:
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert math_reward(r"the answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward(r"\boxed{1,000}", "1000") == 1.0
    assert math_reward("I think 41 then 42.", "42") == 1.0
    assert math_reward(r"\boxed{43}", r"\boxed{42}") == 0.0
    assert math_reward("no number here", "1") == 0.0
    assert math_reward(r"\boxed{\text{(A)}}", "(A)") == 1.0
    assert exact_match("  yes \n", "yes") == 1.0 and exact_match("no", "yes") == 0.0


def test_nonzero_std_filter() -> None:
    args = FlatArgs(make_config())
    same = [Sample(reward=1.0), Sample(reward=1.0)]
    mixed = [Sample(reward=1.0), Sample(reward=0.0)]
    assert check_reward_nonzero_std(args, same).keep is False
    assert check_reward_nonzero_std(args, mixed).keep is True


def test_flat_args_reads_every_slice_and_is_read_only() -> None:
    args = FlatArgs(make_config(rollout={"rollout_temperature": 0.5}, data={"rollout_batch_size": 3}))
    assert args.rollout_temperature == 0.5
    assert args.rollout_batch_size == 3
    assert args.rollout.rollout_temperature == 0.5  # the nested spelling works too
    with pytest.raises(AttributeError, match="no configuration field"):
        _ = args.not_a_flag
    with pytest.raises(AttributeError, match="read-only"):
        args.rollout_temperature = 1.0


def test_load_function_from_module_and_file(tmp_path: Path) -> None:
    assert load_function("tether.rollout.rewards.scoring.math_reward") is math_reward
    hook = tmp_path / "my_hook.py"
    hook.write_text("def f(args, sample):\n    return 1.0\n")
    assert load_function(f"{hook}:f")(None, None) == 1.0
    with pytest.raises(ConfigError, match="--custom-rm-path"):
        load_function("tether.rollout.rewards.scoring.nope", "--custom-rm-path")
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_function("no_such_pkg_xyz.f", "--custom-rm-path")


def _good_sample() -> Sample:
    s = Sample(index=0, group_index=0, rollout_id=0, tokens=[5, 6, 7, 8], status=SampleStatus.COMPLETED)
    append_segment(s, [], [], "", "1")
    s.tokens, s.response_length = [5, 6, 7, 8], 2
    s.loss_mask, s.rollout_log_probs = [1, 1], [-0.5, -0.25]
    return s


def test_hook_output_checked_with_path_and_field() -> None:
    assert len(check_hook_samples("my.hook", _good_sample())) == 1
    bad = _good_sample()
    bad.loss_mask = [1]
    with pytest.raises(HookError, match=r"my\.hook.*loss_mask") as err:
        check_hook_samples("my.hook", bad)
    assert err.value.field == "loss_mask" and err.value.path == "my.hook"
    positive = _good_sample()
    positive.rollout_log_probs = [-0.5, 0.5]
    with pytest.raises(HookError) as err2:
        check_hook_samples("my.hook", [positive])
    assert err2.value.field == "rollout_log_probs[1]"
    with pytest.raises(HookError, match="expected a Sample"):
        check_hook_samples("my.hook", {"tokens": [1]})


def test_segments_and_offpolicy_masking() -> None:
    s = Sample(index=0, tokens=[1, 2])
    append_segment(s, [3, 4], [-0.1, -0.2], "ab", "1")
    append_segment(s, [5], [-0.3], "c", "2", mask_offpolicy=True)
    assert s.tokens == [1, 2, 3, 4, 5] and s.response_length == 3 and s.response == "abc"
    assert s.weight_versions == ["1", "2"]
    assert s.loss_mask == [0, 0, 1] and s.rollout_log_probs == [0.0, 0.0, -0.3]
    fresh = reset_to_prompt(s)
    assert fresh.tokens == [1, 2] and fresh.response_length == 0 and fresh.weight_versions == []
    assert fresh.status == SampleStatus.PENDING


def test_weight_lag() -> None:
    g = [Sample(weight_versions=["3", "5"]), Sample(weight_versions=["weight_v000004"])]
    assert weight_lag(g, 6) == 3
    assert weight_lag([Sample(weight_versions=["default"])], 6) is None


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_source_loads_keys_drops_long_prompts_and_applies_template(tmp_path: Path) -> None:
    rows = [{"q": f"p{i}", "a": str(i), "meta": {"i": i}} for i in range(5)] + [{"q": "x" * 50, "a": "long"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    prompts, dropped = load_prompts(
        path, CharTokenizer(), input_key="q", label_key="a", metadata_key="meta",
        apply_chat_template=False, max_prompt_len=10,
    )  # fmt: skip
    assert dropped == 1 and len(prompts) == 5
    assert (
        prompts[2].label == "2"
        and prompts[2].metadata == {"i": 2}
        and prompts[2].tokens == [ord("p"), ord("2")]
    )
    templ, _ = load_prompts(
        path, CharTokenizer(), input_key="q", label_key="a", metadata_key="meta",
        apply_chat_template=True, max_prompt_len=None,
    )  # fmt: skip
    assert templ[0].prompt == "<user>p0<assistant>"
    with pytest.raises(DataError, match="'missing'"):
        load_prompts(path, CharTokenizer(), input_key="missing", label_key=None, metadata_key="m",
                     apply_chat_template=False, max_prompt_len=None)  # fmt: skip
    (tmp_path / "bad.jsonl").write_text('{"q": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        load_prompts(tmp_path / "bad.jsonl", CharTokenizer(), input_key="q", label_key=None,
                     metadata_key="m", apply_chat_template=False, max_prompt_len=None)  # fmt: skip


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"p{i}", tokens=[100 + i], label=str(i)) for i in range(n)]


def test_data_source_groups_epochs_and_shuffle() -> None:
    ds = DataSource(_records(5), n_samples_per_prompt=3, shuffle=True, seed=7)
    groups = ds.get_samples(4)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert [s.index for g in groups for s in g] == list(range(12))
    assert all(len({s.group_index for s in g}) == 1 for g in groups)
    first_epoch = [g[0].label for g in groups] + [g[0].label for g in ds.get_samples(1)]
    assert sorted(first_epoch) == ["0", "1", "2", "3", "4"] and first_epoch != ["0", "1", "2", "3", "4"]
    second = [g[0].label for g in ds.get_samples(5)]
    assert sorted(second) == sorted(first_epoch) and second != first_epoch and ds.epoch == 1
    same_seed = DataSource(_records(5), n_samples_per_prompt=1, shuffle=True, seed=7)
    assert [g[0].label for g in same_seed.get_samples(5)] == first_epoch


def test_data_source_resume_neither_skips_nor_repeats(tmp_path: Path) -> None:
    ds = DataSource(_records(7), n_samples_per_prompt=2, shuffle=True, seed=1)
    seen = [g[0].label for g in ds.get_samples(3)]
    partial = ds.get_samples(2)
    partial[0][0].tokens.append(999)  # a partial response, kept across the resume
    partial[0][0].response_length = 1
    ds.add_samples([partial[0]])
    seen.append(partial[1][0].label)
    ds.save(tmp_path / "pos.msgpack")
    expected = [g[0].label for g in ds.get_samples(10)]

    resumed = DataSource(_records(7), n_samples_per_prompt=2, shuffle=True, seed=1)
    resumed.load(tmp_path / "pos.msgpack")
    after = resumed.get_samples(10)
    assert [g[0].label for g in after] == expected
    assert after[0][0].tokens[-1] == 999
    # over the resume: the buffered group comes back once, fresh prompts continue without gaps
    labels = seen + [g[0].label for g in after]
    first_epoch = labels[:7]
    assert sorted(first_epoch) == sorted(str(i) for i in range(7)) or partial[0][0].label in first_epoch
    with pytest.raises(DataError, match="saved over 7 prompts"):
        DataSource(_records(6), n_samples_per_prompt=2).load(tmp_path / "pos.msgpack")


def test_debug_dump_roundtrip_and_errors(tmp_path: Path) -> None:
    groups = [[_good_sample()]]
    path = save_rollout(tmp_path / "r_{rollout_id}.msgpack", 3, groups, {"m": 1.0})
    assert path.name == "r_3.msgpack"
    dump = load_rollout(tmp_path / "r_{rollout_id}.msgpack", 3)
    assert dump.groups == groups and dump.metrics == {"m": 1.0} and dump.rollout_id == 3
    (tmp_path / "r_4.msgpack").write_bytes(msgspec.msgpack.encode({"format": "other", "version": 1}))
    with pytest.raises(DebugDumpError, match="format 'other'"):
        load_rollout(tmp_path / "r_{rollout_id}.msgpack", 4)
    with pytest.raises(DebugDumpError, match="no rollout dump"):
        load_rollout(tmp_path / "r_{rollout_id}.msgpack", 5)


def test_router_policies_and_membership() -> None:
    clients = [EngineClient(f"http://127.0.0.1:{9000 + i}", name=f"e{i}") for i in range(3)]
    rr = Router(clients, policy="round_robin")
    assert [rr.pick().name for _ in range(6)] == ["e0", "e1", "e2", "e0", "e1", "e2"]

    ch = Router(clients, policy="consistent_hash")
    keys = [f"session-{i}" for i in range(300)]
    before = {k: ch.pick(k).name for k in keys}
    assert all(ch.pick(k).name == v for k, v in before.items())  # sticky
    assert len(set(before.values())) == 3  # spread over all engines
    ch.remove_engine("e1")
    after = {k: ch.pick(k).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "e1" for k in moved)  # only e1's sessions move
    ch.add_engine(EngineClient("http://127.0.0.1:9001", name="e1"))
    assert {k: ch.pick(k).name for k in keys} == before  # a restarted engine gets its sessions back
    with pytest.raises(ValueError, match="already routed"):
        ch.add_engine(EngineClient("http://127.0.0.1:9001", name="e1"))

"""slime's data-plumbing hooks on tether: --custom-convert-samples-to-train-data-path,
--rollout-data-postprocess-path, --log-correct-samples, --data-source-path and
--disable-rollout-global-dataset (conversions, checks, plan-time refusals, save/load as slime calls them)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.rollout import make_config
from test_train_rank_work import groups

from tether.config import Config, resolve
from tether.rollout.config import RolloutConfig
from tether.rollout.data.custom_source import (
    BlankDataSource,
    HookDataSource,
    build_custom_source,
    check_data_source_class,
)
from tether.rollout.hooks.calls import flat_args, load_function
from tether.rollout.hooks.checks import check_hooks
from tether.rollout.sample import Sample, SampleStatus
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.convert import is_slime_sample
from tether.run.rollout_manager import RolloutManager
from tether.run.train_data_hooks import check_train_data_hooks, load_train_data_hooks
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks
from tether.train.data.slime_train_data import (
    TrainDataError,
    correct_sample_metrics,
    train_batch_from_train_data,
)
from tether.train.rank.work import WorkOptions, rollout_steps

HOOKS = """
import torch
from slime.utils.types import Sample
seen, positions, local = [], [], []
def calls():
    return seen
def partitions():
    return positions, local
def convert(args, samples):
    assert all(isinstance(s, Sample) for s in samples)
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [100.0 + s.index for s in samples],
        "raw_reward": [s.reward for s in samples],
        "loss_masks": [[0] + [1] * (s.response_length - 1) for s in samples],
        "sample_indices": [s.index for s in samples],
    }
def rewards(args, samples):
    raise AssertionError("the converter replaces the reward post-processing")
def postprocess(args, rollout_id, rollout_data):
    seen.append((rollout_id, sorted(rollout_data), list(rollout_data["sample_indices"])))
    raw = rollout_data["raw_reward"]  # the whole rollout's: `partition` indexes it, as in slime
    positions.append(list(rollout_data["partition"]))
    local.append(([raw[p] for p in rollout_data["partition"]], list(rollout_data["local_raw_reward"])))
    rollout_data["loss_masks"][0][:] = 0
    rollout_data["advantages"] = [a * 2 for a in rollout_data["advantages"]]
def drop_masks(args, rollout_id, rollout_data):
    del rollout_data["loss_masks"]
def add_values(args, rollout_id, rollout_data):
    rollout_data["values"] = rollout_data["advantages"]
def two(args, samples, extra):
    return {}
"""

SOURCES = """
import json, os
from slime.rollout.data_source import DataSource
from slime.utils.types import Sample
class Source(DataSource):
    def __init__(self, args):
        self.args, self.offset, self.buffer, self.calls = args, 0, [], []
    def get_samples(self, num_samples):
        out = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        while len(out) < num_samples:
            out.append([Sample(prompt=f"p{self.offset}", label=self.offset) for _ in range(self.args.n_samples_per_prompt)])
            self.offset += 1
        return out
    def add_samples(self, samples):
        self.buffer.extend(samples)
    def save(self, rollout_id):
        self.calls.append(("save", rollout_id))
        os.makedirs(os.path.join(self.args.save, "rollout"), exist_ok=True)
        with open(os.path.join(self.args.save, "rollout", f"s_{rollout_id}.json"), "w") as fh:
            json.dump(self.offset, fh)
    def load(self, rollout_id=None):
        self.calls.append(("load", rollout_id))
        path = os.path.join(self.args.load or "", "rollout", f"s_{rollout_id}.json")
        if os.path.exists(path):
            with open(path) as fh:
                self.offset = json.load(fh)
    def __len__(self):
        return 7
from slime.rollout.data_source import RolloutDataSourceWithBuffer
class Derived(RolloutDataSourceWithBuffer):
    def get_samples(self, num_samples):
        return super().get_samples(num_samples)
class Abstract(DataSource):
    def __init__(self, args):
        pass
class NoSave:
    def __init__(self, args): pass
    def get_samples(self, n): return []
    def add_samples(self, s): pass
    def load(self, rollout_id=None): pass
    def __len__(self): return 0
class TwoArgs(Source):
    def __init__(self, args, other):
        pass
def not_a_class(args):
    return None
"""


@pytest.fixture
def module(tmp_path: Path) -> Path:
    path = tmp_path / "data_hooks.py"
    path.write_text(HOOKS)
    return path


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    path = tmp_path / "sources.py"
    path.write_text(SOURCES)
    return path


def _hooks(algorithm: AlgorithmConfig) -> Any:
    base = make_config()
    hooks = load_train_data_hooks(Config(rollout=base.rollout, data=base.data, algorithm=algorithm))
    assert hooks is not None
    return hooks


def _train_data(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "tokens": [[1, 2, 3, 4], [5, 6, 7]],
        "response_lengths": [2, 1],
        "rewards": [0.5, -0.5],
        "loss_masks": [[1, 0], [1]],
    }
    data.update(over)
    return data


# ----- --custom-convert-samples-to-train-data-path -----
def test_train_data_dict_becomes_the_train_batch() -> None:
    samples = [Sample(index=4, group_index=9), Sample(index=5, group_index=9)]
    batch = train_batch_from_train_data(
        "h",
        _train_data(sample_indices=[5, 4], rollout_log_probs=[[-0.1, -0.2], [-0.3]], truncated=[0, 1]),
        samples,
        per_rollout_loss_mean=False,
    )
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7] and batch.offsets.tolist() == [0, 4, 7]
    assert batch.loss_masks.tolist() == [1, 0, 1]
    assert batch.rewards.tolist() == [0.5, -0.5] and batch.raw_rewards.tolist() == [0.5, -0.5]
    assert batch.rollout_ids.tolist() == [0, 1]  # slime's rule: no rollout id, one per sample
    assert batch.sample_indices.tolist() == [5, 4] and batch.group_indices.tolist() == [9, 9]
    # tether's contract: no log-prob under a 0 in the loss mask
    assert np.allclose(batch.rollout_log_probs, [-0.1, 0.0, -0.3])
    assert np.allclose(batch.loss_weights, [0.5, 0.5])  # 2 trainable tokens in the step


@pytest.mark.parametrize(
    ("over", "key", "why"),
    [
        ({"loss_masks": None}, "loss_masks", "list"),
        ({"values": [[0.0], [0.0]]}, "values", "not a key tether trains with"),
        ({"loss_masks": [[1], [1]]}, "loss_masks[0]", "has 1 values; response_lengths[0] is 2"),
        ({"loss_masks": [[1, 2], [1]]}, "loss_masks", "only 0 and 1"),
        ({"rewards": [1.0]}, "rewards", "has 1 entries for 2 samples"),
        ({"response_lengths": [4, 1]}, "response_lengths[0]", "1..len(tokens[0])-1=3"),
        ({"rollout_mask_sums": [5, 1]}, "rollout_mask_sums", "differ from the loss-mask totals"),
        ({"rewards": [float("nan"), 0.0]}, "rewards", "non-finite"),
    ],
)
def test_bad_train_data_is_refused_naming_the_key(over: dict[str, Any], key: str, why: str) -> None:
    data = _train_data(**over)
    if over.get("loss_masks", 1) is None:
        del data["loss_masks"]
        why = "is missing"
    with pytest.raises(TrainDataError, match=re.escape(why)) as err:
        train_batch_from_train_data("conv.py:f", data, [], per_rollout_loss_mean=False)
    assert err.value.key == key and "conv.py:f" in str(err.value)


def test_converter_replaces_tethers_conversion_and_reward_post_processing(module: Path) -> None:
    hooks = _hooks(
        AlgorithmConfig(
            custom_convert_samples_to_train_data_path=f"{module}:convert",
            custom_reward_post_process_path=f"{module}:rewards",
            normalize_advantages=False,
        )
    )
    [step] = rollout_steps(
        groups(2),
        AlgorithmConfig(normalize_advantages=False),
        WorkOptions(global_batch_size=4),
        dp_size=1,
        hooks=hooks,
    )
    shard = step.train_requests(0)[0].shard
    lengths = [2, 3, 4, 2]
    assert shard.response_lengths.tolist() == lengths
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    assert shard.loss_masks[starts].tolist() == [0, 0, 0, 0]  # the converter's masks
    assert shard.raw_rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    # grpo on the converter's rewards, as given (no group normalisation by tether): 100 + index
    ro = shard.response_offsets
    assert [float(shard.advantages[ro[i]]) for i in range(4)] == [100.0, 101.0, 102.0, 103.0]


# ----- --rollout-data-postprocess-path -----
def test_postprocess_sees_slimes_rollout_data_and_its_changes_train(module: Path) -> None:
    hooks = _hooks(AlgorithmConfig(rollout_data_postprocess_path=f"{module}:postprocess"))
    algorithm = AlgorithmConfig(normalize_advantages=False, disable_rewards_normalization=True)
    # 3 samples over 2 DP ranks: rank 1 gets a filler copy, which the hook must not see
    data = [groups(2)[0], [groups(2)[1][0]]]
    [step] = rollout_steps(data, algorithm, WorkOptions(global_batch_size=3), dp_size=2, hooks=hooks)
    before = [s.advantages.copy() for s in step.shards]
    requests = step.train_requests(7)
    assert step.train_requests(7)[0].shard is requests[0].shard  # called once per step
    calls = load_function(f"{module}:calls")()
    assert [c[0] for c in calls] == [7, 7]  # once per DP shard, with the rollout id
    assert calls[0][1] == sorted(
        [
            "tokens",
            "response_lengths",
            "total_lengths",
            "rewards",
            "raw_reward",
            "local_raw_reward",
            "sample_indices",
            "rollout_ids",
            "partition",
            "loss_masks",
            "rollout_log_probs",
            "advantages",
            "returns",
        ]
    )
    assert sorted(calls[0][2] + calls[1][2]) == [0, 1, 2]  # every real sample once, no filler
    # slime's `partition`: each shard sample's position in the rollout, its index in `raw_reward`
    positions, local = load_function(f"{module}:partitions")()
    # (these samples' indices are their positions: 0, 1, 2 in rollout order)
    assert positions == [c[2] for c in calls]
    for by_position, own in local:
        assert by_position == own
    for shard, old in zip(step.shards, before, strict=True):
        ro = shard.response_offsets
        assert shard.loss_masks[ro[0] : ro[1]].tolist() == [0] * int(shard.response_lengths[0])
        real = np.flatnonzero(shard.loss_weights)
        for i in real:  # what the hook saw doubled; a filler copy untouched
            assert np.allclose(shard.advantages[ro[i] : ro[i + 1]], 2 * old[ro[i] : ro[i + 1]])
    # the step's loss weights follow the new masks: each trainable token weighs 1 / their total
    real = [np.flatnonzero(s.loss_weights) for s in step.shards]
    total = sum(int(s.trainable_per_sample()[r].sum()) for s, r in zip(step.shards, real, strict=True))
    assert all(np.allclose(s.loss_weights[r], 1.0 / total) for s, r in zip(step.shards, real, strict=True))
    assert total == 9 - 2 - 3  # 9 response tokens, the first sample of each shard masked out


@pytest.mark.parametrize(
    ("hook", "why"), [("drop_masks", "loss_masks: was removed"), ("add_values", "values: was added")]
)
def test_postprocess_that_breaks_the_data_is_refused(module: Path, hook: str, why: str) -> None:
    hooks = _hooks(AlgorithmConfig(rollout_data_postprocess_path=f"{module}:{hook}"))
    [step] = rollout_steps(
        groups(1), AlgorithmConfig(), WorkOptions(global_batch_size=2), dp_size=1, hooks=hooks
    )
    with pytest.raises(TrainDataError, match=why):
        step.train_requests(0)


def test_plan_checks_both_train_hooks_signatures(module: Path) -> None:
    check_train_data_hooks(
        AlgorithmConfig(
            custom_convert_samples_to_train_data_path=f"{module}:convert",
            rollout_data_postprocess_path=f"{module}:postprocess",
        )
    )
    with pytest.raises(
        ConfigError, match=r"--custom-convert-samples-to-train-data-path.*fn\(args, samples\)"
    ):
        check_train_data_hooks(AlgorithmConfig(custom_convert_samples_to_train_data_path=f"{module}:two"))
    with pytest.raises(
        ConfigError, match=r"--rollout-data-postprocess-path.*fn\(args, rollout_id, rollout_data\)"
    ):
        check_train_data_hooks(AlgorithmConfig(rollout_data_postprocess_path=f"{module}:convert"))
    with pytest.raises(ConfigError, match=r"--rollout-data-postprocess-path.*no attribute 'nope'"):
        check_train_data_hooks(AlgorithmConfig(rollout_data_postprocess_path=f"{module}:nope"))


# ----- --log-correct-samples -----
def test_correct_samples_metrics_bin_lengths_and_average_nll() -> None:
    [step] = rollout_steps(groups(3), AlgorithmConfig(), WorkOptions(global_batch_size=6), dp_size=2)
    shards = [r.shard for r in step.train_requests(0)]
    no_lp = correct_sample_metrics(shards, max_response_len=8)
    # raw reward 1: samples 1, 3, 5 with response lengths 3, 2, 4; quarters of 8 end at 2, 4, 6, 8
    assert no_lp["rollout/correct_samples"] == 3
    assert no_lp["rollout/correct_length/p25"] == pytest.approx(1 / 3)
    assert no_lp["rollout/correct_length/p50"] == pytest.approx(2 / 3)
    assert no_lp["rollout/correct_length/p75"] == 0 and no_lp["rollout/correct_length/p100"] == 0
    assert "rollout/correct_entropy" not in no_lp  # the step computed no trainer log-probs
    for shard in shards:
        shard.old_log_probs = np.full(int(shard.response_lengths.sum()), -0.25, dtype=np.float32)
    assert correct_sample_metrics(shards, 8)["rollout/correct_entropy"] == pytest.approx(0.25)


def test_log_correct_samples_needs_the_max_response_len() -> None:
    with pytest.raises(ConfigError, match=r"--log-correct-samples.*--rollout-max-response-len"):
        RolloutConfig(log_correct_samples=True)


# ----- --data-source-path -----
class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return "|".join(m["content"] for m in conversation)


def test_plan_refuses_bad_data_source_classes(sources: Path) -> None:
    assert check_data_source_class(None) is None
    assert check_data_source_class("slime.rollout.data_source.RolloutDataSourceWithBuffer") is None
    check_hooks(RolloutConfig(data_source_path=f"{sources}:Source"))
    for name, why in [
        ("not_a_class", "must name a class"),
        ("Abstract", "abstract: __len__, add_samples, get_samples, load, save"),
        ("NoSave", "missing save"),
        ("TwoArgs", r"cannot be built as cls\(args\)"),
        ("Missing", "no attribute 'Missing'"),
    ]:
        with pytest.raises(ConfigError, match=why) as err:
            check_hooks(RolloutConfig(data_source_path=f"{sources}:{name}"))
        assert err.value.key == "--data-source-path"
    # slime's prompt-file classes and subclasses of them run as slime's (test_slime_rollout_data_source)
    check_hooks(RolloutConfig(data_source_path=f"{sources}:Derived"))
    assert check_data_source_class("slime.rollout.data_source.RolloutDataSource") is not None


def _source(
    sources: Path, tmp_path: Path, *, load: str | None = None, global_dataset: bool = True
) -> HookDataSource:
    config = Config(
        rollout=RolloutConfig(data_source_path=f"{sources}:Source"),
        data=make_config(data={"n_samples_per_prompt": 2}).data,
        algorithm=AlgorithmConfig(save=str(tmp_path / "ckpt"), load=load),
    )
    cls = check_data_source_class(config.rollout.data_source_path)
    return build_custom_source(
        cls,
        flat_args(config),
        path="sources.py:Source",
        n_samples_per_prompt=2,
        tokenizer=_Tokenizer(),
        global_dataset=global_dataset,
    )


def test_a_slime_data_source_class_serves_tethers_rollout(sources: Path, tmp_path: Path) -> None:
    source = _source(sources, tmp_path)
    assert len(source) == 7
    groups_ = source.get_samples(2)
    assert [[s.prompt for s in g] for g in groups_] == [["p0", "p0"], ["p1", "p1"]]
    first = groups_[0][0]
    assert isinstance(first, Sample) and first.status is SampleStatus.PENDING
    assert first.tokens == [ord("p"), ord("0")]  # tokenized from the prompt, as slime's generate does
    assert [s.index for g in groups_ for s in g] == [0, 1, 2, 3]
    assert [s.group_index for g in groups_ for s in g] == [0, 0, 1, 1]
    source.add_samples([groups_[1]])  # back to the class, as slime Samples
    assert is_slime_sample(source.instance.buffer[0][0])
    again = source.get_samples(1)[0]
    assert [s.prompt for s in again] == ["p1", "p1"] and [s.index for s in again] == [2, 3]


def test_data_source_saves_and_loads_as_slime_calls_it_and_resumes(sources: Path, tmp_path: Path) -> None:
    config = make_config(rollout={"data_source_path": f"{sources}:Source"})
    manager = RolloutManager(config, router=None)
    manager.data = _source(sources, tmp_path)
    manager.data.get_samples(3)
    asyncio.run(manager._load_source(5))
    asyncio.run(manager._load_source(6))  # once, before the run's first rollout
    asyncio.run(manager.save_source(9))
    assert manager.data.instance.calls == [("load", 4), ("save", 9)]
    assert json.loads((tmp_path / "ckpt" / "rollout" / "s_9.json").read_text()) == 3
    # a resumed run: the class reads its position back from --load
    resumed = RolloutManager(config, router=None)
    resumed.data = _source(sources, tmp_path, load=str(tmp_path / "ckpt"))
    asyncio.run(resumed._load_source(10))
    assert [s.prompt for s in resumed.data.get_samples(1)[0]] == ["p3", "p3"]
    # without the global dataset slime never saves or loads the data source
    off = _source(sources, tmp_path, global_dataset=False)
    off.load_at(4)
    off.save_at(5)
    assert off.instance.calls == []


# ----- --disable-rollout-global-dataset -----
def test_blank_data_source_hands_out_numbered_empty_groups() -> None:
    source = BlankDataSource(n_samples_per_prompt=3)
    got = source.get_samples(2)
    assert [[(s.index, s.group_index, s.prompt, s.tokens) for s in g] for g in got] == [
        [(0, 0, "", []), (1, 0, "", []), (2, 0, "", [])],
        [(3, 1, "", []), (4, 1, "", []), (5, 1, "", [])],
    ]
    source.add_samples([got[1]])
    assert [s.index for s in source.get_samples(1)[0]] == [3, 4, 5]
    assert source.state_dict().next_sample_index == 0  # nothing saved: slime does not save it


def test_disable_rollout_global_dataset_refusals(tmp_path: Path) -> None:
    fn = tmp_path / "fn.py"
    fn.write_text("def generate_rollout(args, rollout_id, data_source, evaluation=False):\n    return []\n")
    cfg = resolve(["--disable-rollout-global-dataset", "--rollout-function-path", f"{fn}:generate_rollout"])
    assert cfg.data.disable_rollout_global_dataset
    assert slime_args(cfg, router_ip=None, router_port=None)["rollout_global_dataset"] is False
    assert slime_args(resolve([]), router_ip=None, router_port=None)["rollout_global_dataset"] is True
    with pytest.raises(ConfigError, match="default rollout without prompts") as err:
        resolve(["--disable-rollout-global-dataset"])
    assert err.value.key == "--disable-rollout-global-dataset"
    with pytest.raises(ConfigError, match=r"--num-epoch.*--disable-rollout-global-dataset"):
        resolve(
            [
                "--disable-rollout-global-dataset",
                "--num-epoch",
                "2",
                "--rollout-function-path",
                f"{fn}:generate_rollout",
            ]
        )
    with pytest.raises(ConfigError, match=r"--prompt-data.*is not read"):
        resolve(
            [
                "--disable-rollout-global-dataset",
                "--prompt-data",
                "x.jsonl",
                "--rollout-function-path",
                f"{fn}:generate_rollout",
            ]
        )


def test_postprocess_sees_the_passes_entropy_under_slimes_keys() -> None:
    # --use-rollout-entropy: slime's rollout_data holds `entropy` (the actor's pass) and `ref_entropy`.
    algorithm = AlgorithmConfig(
        normalize_advantages=False, disable_rewards_normalization=True, use_rollout_entropy=True, kl_coef=0.1
    )
    seen: list[dict[str, Any]] = []

    def hook(rollout_id: int, data: dict[str, Any]) -> None:
        seen.append({k: [t.tolist() for t in data[k]] for k in ("entropy", "ref_entropy")})

    hooks = TrainDataHooks(rollout_data_postprocess=hook, rollout_data_postprocess_path="h.py:hook")
    [step] = rollout_steps(groups(1), algorithm, WorkOptions(global_batch_size=2), dp_size=1, hooks=hooks)
    shard = step.shards[0]
    tokens = int(shard.response_offsets[-1])
    logp = [np.full(tokens, -0.5, dtype=np.float32)]
    entropy = {"actor": [np.arange(tokens, dtype=np.float32)], "ref": [np.ones(tokens, dtype=np.float32)]}
    step.with_log_probs({"actor": logp, "ref": logp}, entropy)
    step.train_requests(3)
    ro = shard.response_offsets
    assert seen == [
        {
            "entropy": [list(range(int(ro[i]), int(ro[i + 1]))) for i in range(2)],
            "ref_entropy": [[1.0] * int(ro[i + 1] - ro[i]) for i in range(2)],
        }
    ]

"""--data-source-path naming a subclass of slime's RolloutDataSource(WithBuffer) (issue #19): the
subclass overrides one method and inherits slime's behaviour, prompts from --prompt-data, slime's
epoch/shuffle position and its save/load in slime's file under --save/--load."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.config import Config
from tether.rollout.config import DataConfig, RolloutConfig
from tether.rollout.cpu_engine.modeling.tiny_model import build_tokenizer
from tether.rollout.data.custom_source import HookDataSource, build_custom_source, check_data_source_class
from tether.rollout.hooks.calls import FlatArgs
from tether.rollout.hooks.checks import check_hooks
from tether.rollout.sample import SampleStatus
from tether.rollout.slime_api.args import slime_args
from tether.train.config import AlgorithmConfig

SOURCES = """
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
class Hinted(RolloutDataSourceWithBuffer):
    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        for group in groups:
            for sample in group:
                sample.prompt = sample.prompt + " (hint)"
        return groups
class ReadOnly(RolloutDataSource):
    def __len__(self):
        return super().__len__()
"""
PROMPTS = [f"sort {i} {9 - i} {i % 3}" for i in range(5)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(8).save_pretrained(str(out))  # type: ignore[attr-defined]
    return out


def _source(tmp: Path, tokenizer_dir: Path, name: str, *, load: Path | None = None) -> HookDataSource:
    sources = tmp / "sources.py"
    sources.write_text(SOURCES)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": p, "label": i}) + "\n" for i, p in enumerate(PROMPTS)))
    path = f"{sources}:{name}"
    config = Config(
        rollout=RolloutConfig(data_source_path=path, hf_checkpoint=str(tokenizer_dir)),
        data=DataConfig(
            prompt_data=str(prompts),
            label_key="label",
            n_samples_per_prompt=2,
            rollout_shuffle=True,
            rollout_seed=7,
        ),
        algorithm=AlgorithmConfig(save=str(tmp / "ckpt"), load=None if load is None else str(load)),
    )
    check_hooks(config.rollout)  # `tether plan` takes the subclass
    args = FlatArgs(config, extra=slime_args(config, router_ip=None, router_port=None))
    from tether.rollout.data.source import load_tokenizer

    return build_custom_source(
        check_data_source_class(path),
        args,
        path=path,
        n_samples_per_prompt=2,
        tokenizer=load_tokenizer(str(tokenizer_dir)),
        global_dataset=True,
    )


def _order(epoch: int) -> list[int]:
    """slime's order of the prompts in `epoch` (Dataset.shuffle: random seeded with seed + epoch)."""
    order = list(range(len(PROMPTS)))
    random.Random(7 + epoch).shuffle(order)
    return order


def _prompts(groups: list[list[Any]]) -> list[str]:
    assert all(len({s.prompt for s in g}) == 1 for g in groups)
    return [g[0].prompt for g in groups]


def test_a_subclass_inherits_slimes_prompts_epochs_shuffle_and_save_load(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    source = _source(tmp_path, tokenizer_dir, "Hinted")
    assert len(source) == 5
    first = source.get_samples(3)
    assert _prompts(first) == [PROMPTS[i] + " (hint)" for i in _order(0)[:3]]
    sample = first[0][0]
    assert sample.status is SampleStatus.PENDING and sample.label == _order(0)[0]
    # tokenized from the prompt the override wrote, when handed to the rollout (slime's generate does)
    assert sample.tokens == source._tokenizer.encode(sample.prompt, add_special_tokens=False)
    assert [(s.index, s.group_index) for g in first for s in g] == [(k, k // 2) for k in range(6)]
    # past the end: the rest of epoch 0, then epoch 1 in its own order
    second = source.get_samples(3)
    assert _prompts(second) == [PROMPTS[i] + " (hint)" for i in [*_order(0)[3:], _order(1)[0]]]
    assert (source.instance.epoch_id, source.instance.sample_offset) == (1, 1)
    # the buffer (WithBuffer): a group put back comes out first
    source.add_samples([second[0]])
    assert source.buffer_size == 1
    assert _prompts(source.get_samples(1)) == [PROMPTS[_order(0)[3]] + " (hint) (hint)"]
    # save(rollout_id) at a checkpoint: slime's file and dict under --save
    source.save_at(4)
    saved = torch.load(tmp_path / "ckpt" / "rollout" / "global_dataset_state_dict_4.pt", weights_only=True)
    assert saved == {
        "sample_offset": 1,
        "epoch_id": 1,
        "sample_group_index": 6,
        "sample_index": 12,
        "metadata": {},
    }
    expected_next = _prompts(source.get_samples(2))
    # a resumed run: load(start_rollout_id - 1) from --load puts it where the checkpoint was
    resumed = _source(tmp_path, tokenizer_dir, "Hinted", load=tmp_path / "ckpt")
    resumed.load_at(4)
    assert (resumed.instance.epoch_id, resumed.instance.sample_offset) == (1, 1)
    again = resumed.get_samples(2)
    assert _prompts(again) == expected_next == [PROMPTS[i] + " (hint)" for i in _order(1)[1:3]]
    assert again[0][0].index == 12 and again[0][0].group_index == 6
    fresh = _source(tmp_path, tokenizer_dir, "Hinted", load=tmp_path / "ckpt")
    fresh.load_at(3)  # no file for that rollout: the data starts from its beginning
    assert _prompts(fresh.get_samples(1)) == [PROMPTS[_order(0)[0]] + " (hint)"]


def test_slimes_plain_rollout_data_source_is_read_only(tmp_path: Path, tokenizer_dir: Path) -> None:
    source = _source(tmp_path, tokenizer_dir, "ReadOnly")
    group = source.get_samples(1)
    assert _prompts(group) == [PROMPTS[_order(0)[0]]] and source.buffer_size == 0
    with pytest.raises(RuntimeError, match="ReadOnly: it is a read-only data source"):
        source.add_samples(group)

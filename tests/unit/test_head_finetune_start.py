"""Where a run whose actor got weights only starts, as slime derives start_rollout_id (issue #19):
0 from an HF --load or --ref-load; 1 from a Megatron checkpoint in --load loaded with --finetune
or a `release/` one (Megatron-LM's load_checkpoint reports iteration 0, slime starts at
iteration + 1), with slime's data position of rollout 0 read from --load when it is there."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from tether.config import resolve
from tether.rollout.data.source import DataSource, DataSourceState, PromptRecord
from tether.run.job import resume
from tether.run.steps import Steps
from tether.train.rank.protocol import LoadedState


class _Trainer:
    """Loads weights only (what --finetune, a release checkpoint or an HF/--ref-load start gives)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, bool, bool]] = []

    async def load(self, path: str, *, finetune: bool = False, hf: bool = False, **_: Any) -> LoadedState:
        self.loads.append((path, finetune, hf))
        where = path if hf else str(Path(path) / "iter_0000007")
        return LoadedState(step=-1, rollout_id=-1, weight_version=0, data_position={}, path=where)


class _Rollouts:
    speculative_early = None  # no first rollout started before the loop

    def __init__(self) -> None:
        prompts = [PromptRecord(prompt=f"p{i}", tokens=[100 + i]) for i in range(10)]
        self.data = DataSource(prompts, n_samples_per_prompt=2)
        self.loaded: list[dict[str, Any]] = []

    def load_position(self, position: dict[str, Any]) -> None:
        self.loaded.append(position)


def _steps() -> Any:
    steps: Any = Steps.__new__(Steps)  # only what `resume` touches
    steps.trainer = _Trainer()
    steps.rollouts = _Rollouts()
    steps.engines = None
    steps.version = 0
    steps.ledger = SimpleNamespace(entries=[])
    steps.position = {}
    steps.events = []
    steps.run_dir = SimpleNamespace(
        event=lambda name, **kw: steps.events.append((name, kw)), discard_steps_after=lambda *a, **k: []
    )
    steps.progress = SimpleNamespace(message=lambda text: None)
    return steps


def _megatron_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    return root


def _hf_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"")
    return root


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--load", "{mega}", "--finetune"], 1),  # Megatron --load, --finetune: iteration 0 + 1
        (["--load", "{mega}", "--finetune", "--ref-load", "{ref}"], 1),
        (["--ref-load", "{ref}"], 0),  # slime_validate_args: start_rollout_id = 0
        (["--load", "{hf}"], 0),  # an HF --load: likewise
    ],
)
def test_weights_only_start_is_slimes_start_rollout_id(tmp_path: Path, flags: list[str], start: int) -> None:
    paths = {
        "mega": str(_megatron_dir(tmp_path / "mega")),
        "ref": str(_megatron_dir(tmp_path / "ref")),
        "hf": str(_hf_dir(tmp_path / "hf")),
    }
    cfg = resolve(["--num-rollout", "4", *[f.format(**paths) for f in flags]])
    steps = _steps()
    assert asyncio.run(resume(cfg, steps)) == start
    name, event = steps.events[-1]
    assert name == "started_from" and event["start"] == start
    assert steps.rollouts.loaded == []  # no slime data state of rollout 0 in --load: the data starts over


def test_finetune_from_megatron_takes_slimes_data_position_of_rollout_0(tmp_path: Path) -> None:
    # slime's rollout manager loads global_dataset_state_dict_{start - 1}.pt from --load.
    mega = _megatron_dir(tmp_path / "mega")
    (mega / "rollout").mkdir()
    saved = {"sample_offset": 2, "epoch_id": 0, "sample_group_index": 2, "sample_index": 4, "metadata": {}}
    torch.save(saved, mega / "rollout" / "global_dataset_state_dict_0.pt")
    steps = _steps()
    cfg = resolve(["--num-rollout", "4", "--load", str(mega), "--finetune"])
    assert asyncio.run(resume(cfg, steps)) == 1
    assert steps.trainer.loads == [(str(mega), True, False)]
    [position] = steps.rollouts.loaded
    assert msgspec.convert(position, DataSourceState) == DataSourceState(
        num_prompts=10, offset=2, next_group_index=2, next_sample_index=4
    )

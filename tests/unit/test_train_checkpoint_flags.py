"""Megatron's checkpoint flags as slime passes them, slime's data-state file, Adam's step in another
tool's optimizer state, and the NaN check (issue #19's checkpoint flags, #18 part 3's resume).

The loads and saves themselves run on trainer ranks: tests/support/train_checks/
check_megatron_ckpt.py (tests/integration/test_train_megatron_checkpoints.py) covers them.
"""

from __future__ import annotations

import asyncio
import io
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from tether.checks.slime_flags import NOT_IMPLEMENTED
from tether.config import Config, resolve
from tether.rollout.data import slime_state as slime_data_state
from tether.rollout.data.source import DataError, DataSource, DataSourceState, PromptRecord
from tether.run.job import _ckpt_step
from tether.runtime.errors import ConfigError
from tether.train.checkpoint.layout import StartChoice, StartKind, select_checkpoint_step
from tether.train.checkpoint.load_save import saved_adam_step
from tether.train.model import megatron_args
from tether.train.rank.step import optimizer_step

with warnings.catch_warnings():
    # torch.compile machinery imported by megatron.core warns about torch's own deprecations.
    warnings.simplefilter("ignore")
    import megatron.core.distributed  # noqa: F401

RUN = ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
FLAGS = (
    "--no-save-optim",
    "--no-load-optim",
    "--no-load-rng",
    "--finetune",
    "--ckpt-step",
    "--ref-ckpt-step",
    "--async-save",
    "--no-check-for-nan-in-loss-and-grad",
)


def parse(*argv: str) -> Config:
    return resolve([*RUN, *argv])


def refused(argv: list[str], flag: str, *words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert err.value.key == flag, err.value
    for word in words:
        assert word in str(err.value), err.value


# ----- the flags parse with slime's / Megatron's types and defaults, and are not refused -----


def test_the_flags_are_tethers_with_megatrons_defaults() -> None:
    assert not any(f in NOT_IMPLEMENTED for f in FLAGS)
    a, m = parse().algorithm, parse().megatron
    assert (a.no_save_optim, a.no_load_optim, a.no_load_rng, a.finetune, a.async_save) == (False,) * 5
    assert (a.ckpt_step, a.ref_ckpt_step, m.no_check_for_nan_in_loss_and_grad) == (None, None, False)
    cfg = parse(
        "--save", "/s", "--load", "/l", "--ref-load", "/r", "--no-save-optim", "--no-load-optim",
        "--no-load-rng", "--finetune", "--ckpt-step", "40", "--ref-ckpt-step", "7", "--async-save",
        "--no-check-for-nan-in-loss-and-grad",
    )  # fmt: skip
    a = cfg.algorithm
    assert (a.no_save_optim, a.no_load_optim, a.no_load_rng, a.finetune, a.async_save) == (True,) * 5
    assert (a.ckpt_step, a.ref_ckpt_step) == (40, 7)
    assert cfg.megatron.no_check_for_nan_in_loss_and_grad


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--no-save-optim"], "--no-save-optim", ("--save",)),
        (["--async-save"], "--async-save", ("--save",)),
        (["--no-load-optim"], "--no-load-optim", ("--load",)),
        (["--no-load-rng", "--save", "/s"], "--no-load-rng", ("--auto-resume",)),
        (["--finetune", "--ref-load", "/r"], "--finetune", ("--load",)),
        (["--ckpt-step", "3"], "--ckpt-step", ("--ref-load",)),
        (["--ckpt-step", "-1", "--load", "/l"], "--ckpt-step", (">= 0",)),
        (["--ref-ckpt-step", "3", "--load", "/l"], "--ref-ckpt-step", ("--ref-load",)),
    ],
)
def test_a_flag_with_nothing_to_act_on_is_refused(argv: list[str], flag: str, words: tuple[str, ...]) -> None:
    refused(argv, flag, *words)


def test_load_flags_apply_to_an_auto_resume_and_ckpt_step_to_a_ref_load() -> None:
    assert (
        parse("--save", "/s", "--auto-resume", "--no-load-optim", "--ckpt-step", "2").algorithm.ckpt_step == 2
    )
    assert parse("--ref-load", "/r", "--ckpt-step", "2").algorithm.ckpt_step == 2


def test_the_step_flags_go_to_the_loads_as_slime_applies_them() -> None:
    a = parse("--load", "/l", "--ref-load", "/r", "--ckpt-step", "5").algorithm
    resume = StartChoice(StartKind.RESUME, "/l", "--load", "")
    ref = StartChoice(StartKind.REF_LOAD, "/r", "--ref-load", "")
    hf = StartChoice(StartKind.HF_LOAD, "/h", "--load", "", hf=True)
    assert _ckpt_step(resume, a) == {"ckpt_step": 5, "ckpt_step_flag": "--ckpt-step"}
    assert _ckpt_step(ref, a) == {"ckpt_step": 5, "ckpt_step_flag": "--ckpt-step"}  # no --ref-ckpt-step
    assert _ckpt_step(hf, a) == {}
    b = parse("--load", "/l", "--ref-load", "/r", "--ckpt-step", "5", "--ref-ckpt-step", "2").algorithm
    assert _ckpt_step(ref, b) == {"ckpt_step": 2, "ckpt_step_flag": "--ref-ckpt-step"}
    assert _ckpt_step(resume, b) == {"ckpt_step": 5, "ckpt_step_flag": "--ckpt-step"}


# ----- step selection (--ckpt-step, --ref-ckpt-step, and --opd-teacher-ckpt-step's) -----


def _complete(root: Path, step: int) -> Path:
    d = root / f"iter_{step:07d}"
    (d / "tether").mkdir(parents=True)
    (d / "metadata.json").write_text("{}")
    (d / "tether" / "run_state.msgpack").write_bytes(b"")
    return d


def test_a_step_selects_that_iteration_not_the_trackers(tmp_path: Path) -> None:
    three, five = _complete(tmp_path, 3), _complete(tmp_path, 5)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    assert select_checkpoint_step(tmp_path, 3) == three
    assert select_checkpoint_step(five, 3) == three  # a checkpoint directory stands for its root
    assert select_checkpoint_step(tmp_path, None) == tmp_path  # the usual choice (the tracker's)
    assert select_checkpoint_step(tmp_path, 0) == tmp_path  # Megatron and slime test it for truth
    (tmp_path / "iter_0000004.tmp").mkdir()  # an unfinished save is no checkpoint of step 4
    with pytest.raises(FileNotFoundError) as err:
        select_checkpoint_step(tmp_path, 4, flag="--ref-ckpt-step")
    assert "--ref-ckpt-step=4" in str(err.value) and "iter_0000003, iter_0000005" in str(err.value)


# ----- Adam's step in a Megatron optimizer state -----


def test_adams_step_is_read_from_the_param_groups_megatron_saves() -> None:
    state = {"optimizer": {"optimizer": {"param_groups": [{"lr": 1.0, "step": 12.0}, {"step": 12}]}}}
    assert saved_adam_step(state) == 12
    chained = {"0": {"optimizer": {"param_groups": [{"step": torch.tensor(4.0)}]}}, "1": {"param_groups": []}}
    assert saved_adam_step(chained) == 4
    assert saved_adam_step({"optimizer": {"param_groups": [{"lr": 1.0}]}}) is None  # SGD: no step
    with pytest.raises(ValueError, match="disagree"):
        saved_adam_step({"a": {"param_groups": [{"step": 1}]}, "b": {"param_groups": [{"step": 2}]}})


# ----- slime's data-state file -----


def _source(n: int = 10) -> DataSource:
    prompts = [PromptRecord(prompt=f"p{i}", tokens=[100 + i]) for i in range(n)]
    return DataSource(prompts, n_samples_per_prompt=2)


def _slime_file(path: Path, saved: dict[str, Any]) -> None:
    """What slime's RolloutDataSource.save writes: torch.save of a plain dict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path)


def test_slimes_position_resumes_tethers_data_source_at_the_same_prompt(tmp_path: Path) -> None:
    # slime drew 7 prompts of its second epoch, groups 0..16, samples 0..33.
    saved = {"sample_offset": 7, "epoch_id": 1, "sample_group_index": 17, "sample_index": 34, "metadata": {}}
    _slime_file(tmp_path / "rollout" / "global_dataset_state_dict_12.pt", saved)
    source = _source()
    state = slime_data_state.read_state(tmp_path, 12, len(source))
    assert state is not None
    source.load_state_dict(state)
    groups = source.get_samples(5)  # slime: prompts 7, 8, 9, then epoch 2 from its start: 0, 1
    assert [g[0].prompt for g in groups] == ["p7", "p8", "p9", "p0", "p1"]
    assert [g[0].group_index for g in groups] == [17, 18, 19, 20, 21]
    assert groups[0][0].index == 34 and groups[-1][-1].index == 43
    assert (source.epoch, source.offset) == (2, 2)
    assert slime_data_state.read_state(tmp_path, 11, len(source)) is None  # slime starts over too


def test_tethers_position_is_written_as_slime_reads_it(tmp_path: Path) -> None:
    source = _source()
    source.get_samples(3)
    position = msgspec.to_builtins(source.state_dict())
    path = slime_data_state.write_state(tmp_path, 2, position)
    assert path == tmp_path / "rollout" / "global_dataset_state_dict_2.pt"
    saved = torch.load(path, weights_only=True)  # slime's load: torch.load of a dict
    assert saved == {
        "epoch_id": 0,
        "sample_offset": 3,
        "sample_group_index": 3,
        "sample_index": 6,
        "metadata": {},
    }
    back = slime_data_state.read_state(tmp_path, 2, len(source))
    assert back == msgspec.structs.replace(source.state_dict(), buffer=[])
    assert slime_data_state.write_state(tmp_path, 3, {}) is None  # no data source: no file
    assert not (tmp_path / "rollout" / "global_dataset_state_dict_3.pt").exists()


@pytest.mark.parametrize(
    ("saved", "words"),
    [
        ({"sample_offset": 11}, "past the 10 prompts"),
        ({"sample_offset": -1}, "sample_offset=-1"),
        ({"epoch_id": "2"}, "epoch_id='2'"),
    ],
)
def test_a_slime_state_that_cannot_be_a_position_names_the_file(
    tmp_path: Path, saved: dict[str, Any], words: str
) -> None:
    path = tmp_path / "rollout" / "global_dataset_state_dict_0.pt"
    _slime_file(path, saved)
    with pytest.raises(DataError) as err:
        slime_data_state.read_state(tmp_path, 0, 10)
    assert str(path) in str(err.value) and words in str(err.value)


def test_a_pickle_that_is_not_plain_data_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "rollout" / "global_dataset_state_dict_0.pt"
    path.parent.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save({"sample_offset": _Optimizer(1.0)}, buf)  # an object: needs the full unpickler
    path.write_bytes(buf.getvalue())
    with pytest.raises(DataError, match="not slime's data state"):
        slime_data_state.read_state(tmp_path, 0, 10)


def test_missing_keys_are_zero_as_slime_reads_them() -> None:
    assert slime_data_state.from_slime({"sample_offset": 2}, 5) == DataSourceState(num_prompts=5, offset=2)


# ----- --no-check-for-nan-in-loss-and-grad -----


def test_the_nan_check_reaches_megatrons_ddp_config() -> None:
    assert megatron_args.ddp_config(parse().megatron).check_for_nan_in_grad is True  # Megatron's default
    off = parse("--no-check-for-nan-in-loss-and-grad").megatron
    assert megatron_args.ddp_config(off).check_for_nan_in_grad is False
    # Megatron-LM turns it off under fp16's dynamic loss scaling (an overflow is the scaler's signal)
    assert megatron_args.ddp_config(parse("--fp16").megatron).check_for_nan_in_grad is False
    assert megatron_args.ddp_config(parse("--fp16", "--loss-scale", "128").megatron).check_for_nan_in_grad
    assert megatron_args.ddp_config(parse("--bf16").megatron).check_for_nan_in_grad


class _Optimizer:
    def __init__(self, norm: float, found_inf: bool = False) -> None:
        self.norm, self.found_inf, self.calls = norm, found_inf, []

    def prepare_grads(self) -> bool:
        self.calls.append("prepare_grads")
        return self.found_inf

    def get_grad_norm(self) -> float:
        self.calls.append("get_grad_norm")
        return self.norm

    def step(self) -> tuple[bool, float, None]:
        self.calls.append("step")
        return True, self.norm, None


def _actor(check: bool, optimizer: _Optimizer) -> Any:
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(check_for_nan_in_grad=check))
    return SimpleNamespace(chunks=[chunk], optimizer=optimizer)


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_without_the_check_a_step_with_a_non_finite_gradient_is_skipped(norm: float) -> None:
    opt = _Optimizer(norm)
    applied, got = optimizer_step(_actor(False, opt))
    assert not applied and got is not None and not math.isfinite(got)
    assert opt.calls == ["prepare_grads", "get_grad_norm"]  # no update: the weights stay as they were
    opt = _Optimizer(1.5, found_inf=True)
    assert optimizer_step(_actor(False, opt)) == (False, None) and "step" not in opt.calls


def test_a_finite_step_is_applied_and_with_the_check_on_the_step_is_megatrons() -> None:
    opt = _Optimizer(2.0)
    assert optimizer_step(_actor(False, opt)) == (True, 2.0) and opt.calls[-1] == "step"
    opt = _Optimizer(math.nan)  # with the check on, the DDP gradient sync has already failed on a NaN
    applied, _ = optimizer_step(_actor(True, opt))
    assert applied and opt.calls == ["step"]


# ----- TransformerEngine's `_extra_state`: kept for a TE model, dropped on the local spec -----


def test_extra_state_is_asked_for_only_by_a_te_model() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from tether.train.checkpoint.megatron import drop_extra_state, uses_transformer_engine

    # Megatron's TE wrappers subclass TE's modules: the class hierarchy says TE.
    te_base = type("LayerNormLinear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module"})
    wrapper = type("TELayerNormColumnParallelLinear", (te_base,), {"__module__": "megatron.core.extensions"})
    assert uses_transformer_engine([torch.nn.Sequential(torch.nn.Linear(2, 2), wrapper())])
    assert not uses_transformer_engine([torch.nn.Sequential(torch.nn.Linear(2, 2))])

    def request() -> dict[str, Any]:
        return {
            f"{name}._extra_state": ShardedObject(f"decoder.layers.{name}._extra_state", None, (2,), (0,))
            for name in ("linear_qkv", "linear_fc1")
        }

    kept = request()
    assert drop_extra_state(kept, keep={"decoder.layers.linear_qkv._extra_state"}) == 1
    assert list(kept) == ["linear_qkv._extra_state"]  # the checkpoint has it: TE restores it
    local = request()
    assert drop_extra_state(local) == 2 and local == {}  # the local spec asks for none


def test_a_pruned_checkpoint_takes_its_slime_data_state_along(tmp_path: Path) -> None:
    import warnings as _w

    import torch.distributed.checkpoint as dcp

    from tether.train.checkpoint import load_save as checkpoint
    from tether.train.checkpoint.retention import prune_checkpoints

    for step in (1, 2, 3):  # complete checkpoints (tether's previous layout, as the retention tests)
        d = tmp_path / checkpoint.iter_dir_name(step)
        with _w.catch_warnings():
            _w.simplefilter("ignore", UserWarning)  # DCP without a process group
            dcp.save(
                {"w": torch.full((4,), float(step))},
                checkpoint_id=str(d / checkpoint.MODEL_OPTIM),
                no_dist=True,
            )
        (d / checkpoint.MODEL_OPTIM / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        state = checkpoint.RunState(step=step, rollout_id=step)
        (d / checkpoint.RUN_STATE).write_bytes(msgspec.msgpack.encode(state))
        checkpoint.write_digests(d)
        (tmp_path / checkpoint.LATEST).write_text(str(step))
        slime_data_state.write_state(
            tmp_path, step, msgspec.to_builtins(DataSourceState(num_prompts=4, offset=step))
        )
    assert [d.step for d in prune_checkpoints(tmp_path, keep_last=1, keep_every=None)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["global_dataset_state_dict_3.pt"]


def test_the_head_takes_a_foreign_checkpoints_position_from_slimes_file(tmp_path: Path) -> None:
    from tether.run.job import _slime_position
    from tether.run.steps import Steps
    from tether.train.rank.protocol import LoadedState

    saved = {"sample_offset": 3, "epoch_id": 0, "sample_group_index": 3, "sample_index": 6, "metadata": {}}
    _slime_file(tmp_path / "rollout" / "global_dataset_state_dict_5.pt", saved)
    events: list[tuple[str, dict[str, Any]]] = []
    steps: Any = Steps.__new__(Steps)  # only what the position needs
    steps.rollouts = SimpleNamespace(data=_source())
    steps.run_dir = SimpleNamespace(event=lambda name, **kw: events.append((name, kw)))
    steps.progress = SimpleNamespace(message=lambda text: events.append(("message", {"text": text})))
    loaded = LoadedState(
        step=5, rollout_id=5, weight_version=0, data_position={}, path=str(tmp_path / "iter_0000005")
    )
    position = asyncio.run(_slime_position(steps, loaded))
    assert msgspec.convert(position, DataSourceState) == DataSourceState(
        num_prompts=10, offset=3, next_group_index=3, next_sample_index=6
    )
    assert events[-1][0] == "slime_data_state"
    loaded.rollout_id = 4  # no file for that iteration: the data starts over, and the run says so
    assert asyncio.run(_slime_position(steps, loaded)) == {} and "start over" in events[-1][1]["text"]
    steps.rollouts.data = None  # no tether data source (a rollout function brings its own data)
    assert asyncio.run(_slime_position(steps, loaded)) == {}

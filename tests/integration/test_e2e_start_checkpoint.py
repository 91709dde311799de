"""The actor starts from the checkpoint slime would pick, and the engines serve it from the first
rollout: `--ref-load` (a Megatron checkpoint made by `tether convert`) with a --load that holds
nothing, and `--load` naming an HF directory, each with weights unlike --hf-checkpoint's (the
first rollout, generated while the trainer loaded, is discarded and drawn again after the sync);
and `--ref-load` converted from --hf-checkpoint itself (that rollout is kept, nothing synced)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.e2e import Workspace, check_clean_exit, jsonl, tether

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def other(ws: Workspace, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an HF model with the workspace model's shape and other weights, its Megatron conversion)."""
    root = tmp_path_factory.mktemp("start")
    hf = root / "other_hf"
    shutil.copytree(ws.model, hf)
    f = hf / "model.safetensors"
    g = torch.Generator().manual_seed(11)
    tensors = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f), metadata={"format": "pt"})
    mg = root / "other_torch_dist"
    tether("convert", "hf-to-megatron", "--hf-checkpoint", str(hf), "--save", str(mg))
    return hf, mg


@pytest.fixture(scope="module")
def same(ws: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workspace model's own Megatron conversion: slime's --ref-load at a first launch."""
    mg = tmp_path_factory.mktemp("same") / "torch_dist"
    tether("convert", "hf-to-megatron", "--hf-checkpoint", str(ws.model), "--save", str(mg))
    return mg


def _step_0_samples(run: Path) -> tuple[list[int], set[str]]:
    """Step 0's sample indices, and the engine weight versions they were generated with."""
    records = [r for r in jsonl(run / "samples.jsonl") if r["step"] == 0]
    assert records
    samples = [s for r in records for s in r["samples"]]
    return sorted(index for index, _, _ in samples), {v for _, _, versions in samples for v in versions}


@pytest.mark.parametrize("start", ["ref-load", "hf-load", "ref-load-hf"])
def test_the_engines_first_rollout_uses_the_loaded_weights(
    ws: Workspace, other: tuple[Path, Path], tmp_path: Path, run_dir: Path, start: str
) -> None:
    hf, mg = other
    weights = tmp_path / "weights"
    empty = tmp_path / "save"  # --load = --save, empty at a first launch: slime starts from --ref-load
    flags = ["--ref-load", str(mg), "--load", str(empty), "--save", str(empty)]
    if start == "hf-load":
        flags = ["--load", str(hf)]
    if start == "ref-load-hf":  # an HF --ref-load: the actor starts from it, the KL reference is it
        flags = ["--ref-load", str(hf), "--use-kl-loss", "--kl-loss-coef", "0.01"]
    run = run_dir
    tether(
        "run",
        *ws.flags(
            run,
            "--num-rollout",
            "1",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(weights),
            "--update-weight-disk-keep-files",
            *flags,
        ),
    )
    events = jsonl(run / "events.jsonl")
    started = [e for e in events if e["event"] == "started_from"]
    assert len(started) == 1 and started[0]["source"] == start.removesuffix("-hf")
    names = [e["event"] for e in events]
    # Published before the first rollout's step trained: v1 is the loaded weights themselves.
    first_sync = names.index("weight_sync")
    assert names.index("ready") > first_sync
    # Rollout 0 began on the engines' --hf-checkpoint weights while the trainer loaded; the
    # loaded weights differ, so it was discarded before the sync and drawn again after it.
    early = next(e for e in events if e["event"] == "rollout_started_early")
    assert early["speculative"] and early["rollout_id"] == 0
    discarded = next(e for e in events if e["event"] == "early_rollout_discarded")
    assert names.index("early_rollout_discarded") < first_sync and "values differ" in discarded["reason"]
    assert "early_rollout_kept" not in names
    # Drawn again after the sync: the discarded rollout's prompts were put back.
    assert _step_0_samples(run) == (list(range(16)), {"1"})
    published = load_file(str(weights / "weight_v000001" / "model-00001-of-00001.safetensors"))
    source = load_file(str(hf / "model.safetensors"))
    assert sorted(published) == sorted(source)
    assert all(torch.equal(published[k], source[k]) for k in source)
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m["step"] == 0]
    # The engine generated rollout 0 with the trainer's weights: their log-probs agree.
    assert metrics and metrics[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    if start == "ref-load-hf":  # actor and reference both hold the HF --ref-load's weights
        assert abs(metrics[0]["train/kl"]) < 1e-6
    assert next(e["version"] for e in jsonl(run / "ledger.jsonl")) == 1
    check_clean_exit(run)


def test_a_ref_load_of_the_engines_weights_keeps_the_early_rollout(
    ws: Workspace, same: Path, tmp_path: Path, run_dir: Path
) -> None:
    """slime's first launch (`--ref-load` the base model's conversion, `--load` = `--save`
    empty): the rollout generated while the trainer loaded is trained on, nothing is published
    before the first step, and the engine's log-probs agree with the trainer's."""
    empty = tmp_path / "save"
    tether(
        "run",
        *ws.flags(
            run_dir, "--num-rollout", "1", "--ref-load", str(same), "--load", str(empty), "--save", str(empty)
        ),
    )
    events = jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert next(e for e in events if e["event"] == "rollout_started_early")["speculative"]
    assert names.index("rollout_started_early") < names.index("early_rollout_kept") < names.index("ready")
    assert "early_rollout_discarded" not in names
    assert names.index("weight_sync") > names.index("ready")  # the first publish is step 0's
    started = next(e for e in events if e["event"] == "started_from")
    assert started["source"] == "ref-load" and Path(started["path"]).is_relative_to(same)
    assert _step_0_samples(run_dir) == (list(range(16)), {"default"})  # the weights the engine loaded
    metrics = [m for m in jsonl(run_dir / "metrics.jsonl") if m["step"] == 0]
    assert metrics and metrics[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    check_clean_exit(run_dir)


def test_save_hf_writes_every_checkpoint_as_slime_names_it(
    ws: Workspace, tmp_path: Path, run_dir: Path
) -> None:
    """--save-hf is formatted with the checkpoint's rollout id at every save (slime's meaning).

    The same run saves with --async-save: checkpoint 0 is written in the background and completed
    before step 1's weight update, the last one before the run ends; both are complete, and
    each has slime's data-position file beside it (`rollout/global_dataset_state_dict_N.pt`)."""
    save, out = tmp_path / "save", tmp_path / "hf"
    tether(
        "run",
        *ws.flags(
            run_dir,
            "--num-rollout",
            "2",
            "--save",
            str(save),
            "--save-interval",
            "1",
            "--save-hf",
            str(out / "hf_{rollout_id}"),
            "--async-save",
        ),
    )
    assert sorted(p.name for p in out.iterdir()) == ["hf_0", "hf_1"]
    saved = [e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "saved_hf"]
    assert [(e["rollout_id"], e["path"]) for e in saved] == [(0, str(out / "hf_0")), (1, str(out / "hf_1"))]
    first = load_file(str(out / "hf_0" / "model-00001-of-00001.safetensors"))
    second = load_file(str(out / "hf_1" / "model-00001-of-00001.safetensors"))
    base = load_file(str(ws.model / "model.safetensors"))
    assert sorted(first) == sorted(base) and (out / "hf_1" / "config.json").is_file()
    assert any(not torch.equal(first[k], second[k]) for k in base), "step 1 did not change the weights"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000000",
        "iter_0000001",
    ]
    for step in (0, 1):  # completed (renamed into place with its digests), not left as .tmp
        assert (save / f"iter_{step:07d}" / "tether" / "digests.msgpack").is_file()
        slime_state = torch.load(save / "rollout" / f"global_dataset_state_dict_{step}.pt", weights_only=True)
        assert set(slime_state) == {
            "sample_offset",
            "epoch_id",
            "sample_group_index",
            "sample_index",
            "metadata",
        }
        # 4 prompts of 4 samples per step drawn by the end of step `step`
        assert (slime_state["sample_group_index"], slime_state["sample_index"]) == (
            4 * (step + 1),
            16 * (step + 1),
        )
    check_clean_exit(run_dir)

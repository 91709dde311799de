"""`tether convert`: HF -> Megatron (slime's release layout) -> HF is bit-identical, in one process
and with the model split over two pipeline stages (--nproc 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.e2e import tether

pytestmark = pytest.mark.slow


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    path = tmp_path_factory.mktemp("convert") / "hf"
    write_tiny_model(path, TinyModelSpec(arch="qwen3", layers=2, seed=3))
    f = path / "model.safetensors"
    g = torch.Generator().manual_seed(5)  # every weight off its init value (norms start at 1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_file(str(f)).items()}
    save_file(perturbed, str(f), metadata={"format": "pt"})
    return path


def _bf16_copy(hf: Path, to: Path) -> Path:
    """The model in bfloat16, as most released checkpoints are."""
    import shutil

    shutil.copytree(hf, to)
    f = to / "model.safetensors"
    save_file(
        {k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"}
    )
    cfg = json.loads((to / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (to / "config.json").write_text(json.dumps(cfg))
    return to


@pytest.mark.parametrize(("nproc", "dtype"), [("1", "float32"), ("2", "float32"), ("1", "bfloat16")])
def test_hf_to_megatron_to_hf_is_bit_identical(hf: Path, tmp_path: Path, nproc: str, dtype: str) -> None:
    if dtype == "bfloat16":
        hf = _bf16_copy(hf, tmp_path / "hf_bf16")
    mg, out = tmp_path / "mg", tmp_path / "out"
    tether("convert", "hf-to-megatron", "--hf-checkpoint", str(hf), "--save", str(mg), "--nproc", nproc)
    # slime's converter layout: the tracker says "release", the weights are in release/.
    assert (mg / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (mg / "release" / "metadata.json").is_file() and not (mg / "release.tmp").exists()
    tether("convert", "megatron-to-hf", "--load", str(mg), "--hf-checkpoint", str(hf), "--output", str(out))
    src, got = _tensors(hf), _tensors(out)
    assert sorted(got) == sorted(src)
    for name, tensor in src.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


def test_convert_help_lists_both_directions() -> None:
    said = tether("convert", "--help").stdout
    assert "hf-to-megatron" in said and "megatron-to-hf" in said


def test_convert_refuses_a_non_empty_save_directory(hf: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("1")
    done = tether(
        "convert",
        "hf-to-megatron",
        "--hf-checkpoint",
        str(hf),
        "--save",
        str(tmp_path / "taken"),
        check=False,
    )
    assert done.returncode == 2 and "--save" in done.stderr and "not empty" in done.stderr

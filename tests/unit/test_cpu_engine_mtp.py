"""Checkpoints with multi-token-prediction (MTP) layers in the CPU engine and `tether init-model`:
DeepSeek-V3/GLM-4.7-Flash/GLM-4.5 (MTP layers numbered after the decoder's) and MiMo (Qwen2 plus
model.mtp_layers). The engine serves the decoder (logits equal transformers', which drops the
MTP layers too), accepts the MTP tensors in a full load and in updates and leaves them out; what
init-model refuses is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.hf_reference import load_causal_lm

from tether.rollout.cpu_engine.modeling import tiny_model
from tether.rollout.cpu_engine.modeling.model import (
    KVCache,
    ModelConfig,
    TinyLM,
    WeightMismatch,
    read_safetensors_dir,
)
from tether.runtime.errors import ConfigError

CASES = {
    "mimo": {"arch": "mimo"},
    "deepseek_v3": {"arch": "deepseek_v3", "mtp_layers": 1},
    "glm4_moe": {"arch": "glm4_moe", "mtp_layers": 2},
    # GLM-4.7-Flash's transformers class ignores only its real layer 47; the tiny one's MTP layer is
    # an unexpected tensor that transformers leaves out too.
    "glm4_moe_lite": {"arch": "glm4_moe_lite", "mtp_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def mtp_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = tiny_model.TinyModelSpec(**CASES[request.param])  # type: ignore[arg-type]
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp(request.param), spec)


def _mtp_names(path: Path, named: dict[str, torch.Tensor]) -> list[str]:
    raw = json.loads((path / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    return [
        n
        for n in named
        if n.startswith("model.mtp_layers.")
        or (n.startswith("model.layers.") and int(n.split(".")[2]) >= layers)
    ]


def test_init_model_writes_mtp_layers_under_the_family_names(mtp_model: Path) -> None:
    raw = json.loads((mtp_model / "config.json").read_text())
    named = read_safetensors_dir(mtp_model)
    mtp = _mtp_names(mtp_model, named)
    n = raw["num_nextn_predict_layers"]
    assert n >= 1 and raw["num_hidden_layers"] == 2
    if raw["model_type"] == "mimo":
        assert raw["architectures"] == ["MiMoForCausalLM"]
        assert (
            "model.mtp_layers.0.input_proj.weight" in mtp
            and "model.mtp_layers.0.self_attn.q_proj.bias" in mtp
        )
    else:
        for i in range(n):
            assert f"model.layers.{2 + i}.eh_proj.weight" in mtp
            assert f"model.layers.{2 + i}.shared_head.norm.weight" in mtp
            assert f"model.layers.{2 + i}.mlp.gate.weight" in mtp  # the MTP layer's own MoE block
    assert named[mtp[0]].dtype == torch.float32


def test_engine_serves_the_decoder_and_leaves_the_mtp_layers_out(mtp_model: Path) -> None:
    cfg = ModelConfig.from_dir(mtp_model)
    named = read_safetensors_dir(mtp_model)
    mtp = _mtp_names(mtp_model, named)
    assert cfg.mtp_layers >= 1 and all(cfg.unused(n) for n in mtp)
    model = TinyLM(cfg, named)
    assert sorted(model.params) == sorted(cfg.expected_shapes())  # nothing of the MTP layers kept
    seq = list(range(3, 20))
    cache = KVCache(cfg)
    with torch.inference_mode():
        got = model.prefill([seq], [cache.allocate(32)], cache)
        want = load_causal_lm(mtp_model)(torch.tensor([seq])).logits[0, -1]
    assert float((got[0] - want).abs().max()) < 1e-5
    # An update may carry MTP tensors (a checkpoint reloaded from disk): accepted, left out.
    model.load({mtp[0]: named[mtp[0]] * 2}, complete=False)
    assert mtp[0] not in model.params
    # A layer past the MTP layers is still an unknown name.
    beyond = f"model.layers.{cfg.layers + cfg.mtp_layers}.input_layernorm.weight"
    assert not cfg.unused(beyond)
    with pytest.raises(WeightMismatch, match="unknown parameter name"):
        model.load({beyond: torch.ones(cfg.hidden)}, complete=False)


def test_checkpoint_without_mtp_layers_refuses_their_names(tmp_path: Path) -> None:
    path = tiny_model.write_tiny_model(tmp_path / "m", tiny_model.TinyModelSpec(arch="deepseek_v3"))
    cfg = ModelConfig.from_dir(path)
    assert cfg.mtp_layers == 0
    assert not cfg.unused("model.layers.2.eh_proj.weight")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"arch": "qwen3", "mtp_layers": 1}, "only deepseek_v3, glm4_moe, glm4_moe_lite, kimi_k2, mimo"),
        ({"arch": "mimo", "mtp_layers": 0}, "at least one MTP layer"),
        ({"arch": "deepseek_v3", "mtp_layers": -1}, "at least 0"),
    ],
)
def test_init_model_refuses_mtp_layers_by_flag(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as err:
        tiny_model.TinyModelSpec(**fields)  # type: ignore[arg-type]
    assert "--mtp-layers" in str(err.value)

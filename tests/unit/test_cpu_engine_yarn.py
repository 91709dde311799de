"""YaRN rope scaling in the CPU engine against transformers, in this process: DeepSeek-V3's
multi-latent attention (the tables' mscale ratio and mscale_all_dim's softmax factor), written the
way DeepSeek's own config.json writes it (`rope_scaling`, `type`) and the way transformers 5 does
(`rope_parameters`), Kimi-K2's config.json (model_type kimi_k2, beta_fast = beta_slow = 1), GLM-5's
and DeepSeek-V3.2's (whose sparse-attention indexer rotates with the same tables), and a
plain-attention family (Qwen3, whose tables carry 0.1·ln(factor)+1).
Prefill and decode logits equal transformers' over the sequence within 1e-5."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tether.rollout.cpu_engine.modeling import tiny_model
from tether.rollout.cpu_engine.modeling.model import KVCache, ModelConfig, TinyLM, read_safetensors_dir
from tether.rollout.cpu_engine.modeling.rope import YarnConfig, inv_freq

TOL = 1e-5
# A short pretraining context puts the ramp between beta_fast's and beta_slow's dims inside the
# tiny models' rotary dims, so extrapolated, blended and interpolated frequencies all occur.
DEEPSEEK_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # DeepSeek-V3's own config.json: `rope_scaling` with `type`, rope_theta at the top level.
    "deepseek_v3_rope_scaling": ("deepseek_v3", {"rope_scaling": DEEPSEEK_YARN}),
    # transformers 5's layout; mscale equal to mscale_all_dim (DeepSeek-V3, Kimi K2): tables unscaled.
    "deepseek_v3_rope_parameters": (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            }
        },
    ),
    # Kimi-K2's config.json (its rope_scaling scaled to the tiny context), against DeepSeek-V3's model.
    "kimi_k2": (
        "kimi_k2",
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
        },
    ),
    # GLM-5 and DeepSeek-V3.2: the sparse-attention indexer rotates its queries and keys with the
    # same scaled tables (pairs for GLM-5, halves for DeepSeek-V3.2) and picks 4 of the 40 keys.
    **{
        arch: (arch, {"rope_parameters": {**DEEPSEEK_YARN, "rope_type": "yarn", "rope_theta": 10000.0}})
        for arch in ("glm_moe_dsa", "deepseek_v32")
    },
    # Qwen3's long-context recipe: factor and original length only (attention factor derived).
    "qwen3": (
        "qwen3",
        {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def yarn_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, change = CASES[request.param]
    spec = tiny_model.TinyModelSpec(arch=arch, layers=2, max_position=256)  # type: ignore[arg-type]
    path = tiny_model.write_tiny_model(tmp_path_factory.mktemp(request.param), spec)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 10000.0
    raw.update(change)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_yarn_forward_equals_transformers(yarn_model: Path) -> None:
    from support.hf_reference import load_causal_lm  # Kimi-K2's reference is DeepSeek-V3's model

    cfg = ModelConfig.from_dir(yarn_model)
    assert cfg.yarn is not None
    model, cache = TinyLM(cfg, read_safetensors_dir(yarn_model)), KVCache(cfg)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, cfg.vocab, (40,), generator=g).tolist()
    slot = cache.allocate(64)
    with torch.inference_mode():
        first = model.prefill([seq[:30]], [slot], cache)
        steps = [model.decode([t], [30 + j], [slot], cache) for j, t in enumerate(seq[30:])]
    hf = load_causal_lm(yarn_model)
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0]
        plain = TinyLM(msgspec.structs.replace(cfg, yarn=None), model.params)
        plain_cache = KVCache(cfg)
        unscaled = plain.prefill([seq[:30]], [plain_cache.allocate(64)], plain_cache)
    assert (first[0] - ref[29]).abs().max() < TOL
    for j, step in enumerate(steps):
        assert (step[0] - ref[30 + j]).abs().max() < TOL, j
    # YaRN changed the answer: without it the same weights give logits beyond the tolerance.
    assert (unscaled[0] - ref[29]).abs().max() > 10 * TOL


def test_yarn_frequencies_blend_between_extrapolation_and_interpolation() -> None:
    yarn = YarnConfig.from_params({"factor": 8.0, "original_max_position_embeddings": 64}, 512)
    plain, scaled = inv_freq(16, 1e4, None), inv_freq(16, 1e4, yarn)
    assert scaled[0] == plain[0]  # the fastest dims keep their frequency
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # the slowest are divided by the factor
    assert ((scaled < plain) & (scaled > plain / 8.0)).any()  # and some lie on the ramp between
    # The factor left out: max_position_embeddings / original_max_position_embeddings.
    assert YarnConfig.from_params({"original_max_position_embeddings": 64}, 512).factor == 8.0

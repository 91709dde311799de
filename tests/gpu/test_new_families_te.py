"""This year's families on a GPU under TransformerEngine's spec, logits equal to transformers':
- DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): the indexer reads the q latent through TE's
  fused q norm (linear_q_up_proj.layer_norm_weight); the masked core attention replaces TE's fused one.
- Gated DeltaNet (Qwen3-Next, Qwen3.5 dense and MoE): the linear-attention layers hold TE's linears
  and a TE input norm of their own (zero-centred), beside TE's fused full-attention layers.
Skipped without CUDA or TransformerEngine (the CPU side: tests/integration/test_train_model.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a CUDA device and TransformerEngine",
)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from support.net import free_port

    from tether.train.parallel import topology

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    topo = topology.init_distributed(1, 1)
    try:
        yield topo
    finally:
        topology.destroy()


@needs_te
@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_family_on_the_te_spec_equals_transformers(one_rank: object, tmp_path: Path, arch: str) -> None:
    from support.hf_reference import load_causal_lm

    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
    from tether.train.config import AlgorithmConfig, MegatronConfig
    from tether.train.model import build
    from tether.train.model.capabilities import Capabilities
    from tether.train.rank import step

    path = write_tiny_model(tmp_path / arch, TinyModelSpec(arch=arch, layers=4, bpe_merges=0))  # type: ignore[arg-type]
    assert Capabilities.detect().transformer_engine
    opts = build.ModelOptions(
        hf_checkpoint=str(path),
        algorithm=AlgorithmConfig(lr=1e-4),
        megatron=MegatronConfig(lr_decay_style="constant", moe_token_dispatcher_type="alltoall"),
    )
    actor = build.build_actor(opts, one_rank)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, actor.arch.vocab_size, (2, 24), generator=g)
    pos = torch.arange(24).unsqueeze(0).expand_as(tokens)
    for chunk in actor.chunks:
        chunk.eval()
    (got,) = step.forward_logits(
        actor.chunks, actor.config, [step.MicroBatch(tokens, pos)], actor.arch.vocab_size
    )
    hf = load_causal_lm(path).cuda()
    with torch.no_grad():
        want = hf(tokens.cuda()).logits
    assert float((got.cuda() - want).abs().max()) < 1e-4

"""TransformerEngine's `_extra_state` (FP8 scaling factors, amax history) survives a checkpoint into
a TE model through tether's load; skipped without CUDA or TransformerEngine.

A TE GPT model runs FP8 ("hybrid" delayed scaling) steps, so its FP8 metadata moves off its
initial values; Megatron's `sharded_state_dict` + `dist_checkpointing.save` write it (Megatron-LM's
layout); `tether.train.checkpoint.load_save._load_model` loads it into a fresh TE model, whose FP8 scales and
amax histories then equal the saved model's. The CPU (local-spec) side drops these entries:
tests/unit/test_train_checkpoint_flags.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a CUDA device and TransformerEngine",
)


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    torch.cuda.set_device(0)
    # Bound to its device: NCCL's barrier() (Megatron's checkpoint save calls it) otherwise warns
    # that it guesses the device, and warnings are errors here.
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _te_gpt() -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=256,
        bf16=True,
        params_dtype=torch.bfloat16,
        fp8="hybrid",
        fp8_amax_history_len=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=256,
        max_sequence_length=64,
    )
    return model.cuda()


def _fp8_meta(model: Any) -> dict[str, torch.Tensor]:
    """Every TE module's FP8 scales and amax histories, by module name."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for kind in ("scaling_fwd", "scaling_bwd"):
            scaling = meta.get(kind)
            if scaling is not None:
                out[f"{name}.{kind}.scale"] = scaling.scale.detach().clone()
                out[f"{name}.{kind}.amax_history"] = scaling.amax_history.detach().clone()
    return out


@needs_te
@pytest.mark.usefixtures("one_rank")
# Megatron's GPT layer specs announce at import that Apex is absent (TE's spec needs no Apex).
@pytest.mark.filterwarnings("ignore:Apex is not installed. Falling back to Torch Norm:UserWarning")
def test_te_fp8_state_loads_into_a_te_model(tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing

    from tether.train.checkpoint import load_save as checkpoint
    from tether.train.checkpoint.megatron import extra_state_to_load, uses_transformer_engine

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or newer")
    src = _te_gpt()
    assert uses_transformer_engine([src])
    tokens = torch.randint(0, 256, (2, 32), device="cuda")
    positions = torch.arange(32, device="cuda").expand(2, 32)
    for _ in range(3):  # delayed scaling: the scales follow the amax history of earlier steps
        src(tokens, positions, attention_mask=None).float().sum().backward()
    want = _fp8_meta(src)
    assert want, "the TE model has no FP8 metadata"
    target = tmp_path / "iter_0000001"
    target.mkdir()
    dist_checkpointing.save({"model": src.sharded_state_dict(), "iteration": 1}, str(target))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    assert extra_state_to_load([src], target)  # the checkpoint has TE's `_extra_state`

    dst = _te_gpt()
    fresh = _fp8_meta(dst)
    assert any(not torch.equal(fresh[k], want[k]) for k in want), "the FP8 state did not move off its start"
    checkpoint._load_model([dst], target)
    got = _fp8_meta(dst)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(a, b), name

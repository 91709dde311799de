"""In-process units of Qwen3.5 (`tether.train.model.families.qwen3_5`, `hf_config`, `hf_convert`): linear
attention's four HF projections against Megatron's in_proj, the published vision-language config
and its text-only form read by `load_arch`, what is refused, slime's Qwen3.5 flags and spec, and
fused experts read per expert and written back fused with the tensors the trainer keeps aside.
The whole model (logits against transformers, round trips at DP/TP/PP/EP, save_hf, training steps)
is checked by tests/integration/test_train_model.py (CHECK_MODEL_FAMILIES=qwen3_5,qwen3_5_moe)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tether.runtime.errors import ConfigError
from tether.train.model.families import qwen3_5, qwen3_next
from tether.train.model.hf_config import check_architecture_flags, check_parallel, load_arch
from tether.train.model.hf_convert import HFWeights, in_base_form

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

SHAPE = qwen3_next.LinearAttentionShape(key_heads=2, value_heads=4, key_dim=8, value_dim=6)


def test_in_proj_is_the_four_projections_stacked_and_round_trips() -> None:
    # transformers' module projects with in_proj_qkv/z/b/a; Megatron's in_proj rows [q; k; v; z; b; a]
    # must give the same q, k, v, z, b, a for the same input.
    cfg = Qwen3_5TextConfig(
        hidden_size=16,
        linear_num_key_heads=SHAPE.key_heads,
        linear_num_value_heads=SHAPE.value_heads,
        linear_key_head_dim=SHAPE.key_dim,
        linear_value_head_dim=SHAPE.value_dim,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    module = hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    parts = [
        module.in_proj_qkv.weight,
        module.in_proj_z.weight,
        module.in_proj_b.weight,
        module.in_proj_a.weight,
    ]
    in_proj = qwen3_5.in_proj_to_mcore([p.detach() for p in parts])
    assert list(in_proj.shape) == [sum(SHAPE.in_proj_parts()), 16]
    x = torch.randn(3, 16)
    q, k, v, z, b, a = (x @ w.T for w in in_proj.split(SHAPE.in_proj_parts()))
    qkv = module.in_proj_qkv(x)
    assert torch.equal(torch.cat((q, k, v), -1), qkv)
    assert torch.equal(z, module.in_proj_z(x)) and torch.equal(b, module.in_proj_b(x))
    assert torch.equal(a, module.in_proj_a(x))
    back = qwen3_5.in_proj_to_hf(in_proj, SHAPE)
    assert all(torch.equal(got, want) for got, want in zip(back, parts, strict=True))


TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {
        "rope_theta": 10000000.0,
        "rope_type": "default",
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "vocab_size": 320,
    "model_type": "qwen3_5_text",
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def _write(tmp: Path, config: dict[str, object]) -> Path:
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def _published(moe: bool = False, **top: object) -> dict[str, object]:
    """config.json as Qwen3.5 is published: the decoder under text_config beside a vision tower."""
    text = {**TEXT, **(MOE if moe else {}), "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"}
    if moe:
        del text["intermediate_size"]
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32},
        "tie_word_embeddings": False,
        **top,
    }


def test_load_arch_reads_the_published_vision_language_config(tmp_path: Path) -> None:
    arch = load_arch(_write(tmp_path, _published()))
    assert arch.model_type == "qwen3_5" and not arch.is_moe
    assert arch.hf_prefix == "model.language_model."
    assert set(arch.hf_kept_prefixes) == {"model.visual.", "mtp."}
    assert arch.linear_attention == (1, 1, 1, 0) and arch.linear_attention_split
    assert arch.attention_output_gate and arch.zero_centered_norms and arch.qk_layernorm
    assert arch.rotary_percent == 0.25 and arch.rope_theta == 1e7 and arch.ffn_hidden_size == 128
    tied = load_arch(_write(tmp_path, _published(tie_word_embeddings=True)))
    assert tied.tie_word_embeddings  # the top-level key, as transformers ties the VLM's head
    moe = load_arch(_write(tmp_path, _published(moe=True)))
    assert moe.model_type == "qwen3_5_moe" and moe.num_experts == 4 and moe.moe_layer_freq == (1, 1, 1, 1)
    assert moe.moe_shared_expert_intermediate_size == 48 and moe.moe_shared_expert_gate
    assert moe.moe_router_pre_softmax is False  # norm_topk_prob defaults to True
    assert moe.ffn_hidden_size == 32  # no dense FFN in the text config


def test_load_arch_reads_the_text_only_form(tmp_path: Path) -> None:
    arch = load_arch(_write(tmp_path, TEXT))  # Qwen3_5ForCausalLM's save: model_type qwen3_5_text
    assert arch.model_type == "qwen3_5" and arch.hf_prefix == "model."
    assert arch.hf_kept_prefixes == ("mtp.",)
    moe = load_arch(_write(tmp_path, {**TEXT, **MOE, "model_type": "qwen3_5_moe_text"}))
    assert moe.model_type == "qwen3_5_moe" and moe.is_moe


def test_linear_attention_at_tp2_needs_sequence_parallel_and_takes_context_parallel(tmp_path: Path) -> None:
    arch = load_arch(_write(tmp_path, _published()))
    check_parallel(arch, 2, 1, sequence_parallel=True)
    with pytest.raises(ConfigError, match="only with --sequence-parallel") as err:
        check_parallel(arch, 2, 1, sequence_parallel=False)
    assert err.value.key == "--tensor-model-parallel-size"
    check_parallel(arch, 1, 1, cp_size=2)  # the sequence gathered for linear attention


def test_slimes_qwen3_5_flags_and_spec_are_checked_against_the_hf_config(tmp_path: Path) -> None:
    spec = ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    # What slime's scripts/models/qwen3.5-*.sh pass (sizes aside).
    flags = {
        "spec": spec,
        "attention_output_gate": True,
        "use_gated_attention": True,
        "apply_layernorm_1p": True,
        "qk_layernorm": True,
        "rotary_percent": 0.25,
        "rotary_base": 10000000,
        "kv_channels": 16,
        "model_name": "qwen3_5",
    }
    check_architecture_flags(load_arch(_write(tmp_path, _published())), flags)
    moe_flags = {**flags, "moe_shared_expert_gate": True, "num_experts": 4, "moe_ffn_hidden_size": 32}
    check_architecture_flags(load_arch(_write(tmp_path, _published(moe=True))), moe_flags)
    next_dir = tmp_path / "next"
    next_dir.mkdir()
    qwen3_next_arch = load_arch(_write(next_dir, {**TEXT, **MOE, "model_type": "qwen3_next"}))
    with pytest.raises(ConfigError, match=r"builds Qwen3\.5's layers") as err:
        check_architecture_flags(qwen3_next_arch, {"spec": spec})
    assert err.value.key == "--spec"
    with pytest.raises(ConfigError, match="names another family") as err:
        check_architecture_flags(qwen3_next_arch, {"model_name": "qwen3_5"})


def _checkpoint(tmp: Path, tensors: dict[str, torch.Tensor]) -> HFWeights:
    save_file(tensors, str(tmp / "model.safetensors"))
    return HFWeights(tmp)


def test_fused_experts_are_read_per_expert_and_written_back_fused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    experts, inter, hidden = 3, 4, 5
    prefix = "model.language_model.layers.0.mlp.experts."
    base = {
        prefix + "gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=g),
        prefix + "down_proj": torch.randn(experts, hidden, inter, generator=g),
        "model.language_model.norm.weight": torch.randn(hidden, generator=g),
        "model.visual.merger.linear_fc1.weight": torch.randn(2, 2, generator=g),
        "mtp.fc.weight": torch.randn(2, 4, generator=g),
    }
    weights = _checkpoint(tmp_path, base)
    assert weights.fused_experts()
    per_expert = {}
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            per_expert[f"{prefix}{e}.{proj}.weight"] = weights.get(f"{prefix}{e}.{proj}.weight")
    assert torch.equal(per_expert[prefix + "1.gate_proj.weight"], base[prefix + "gate_up_proj"][1, :inter])
    assert torch.equal(per_expert[prefix + "1.up_proj.weight"], base[prefix + "gate_up_proj"][1, inter:])
    assert torch.equal(per_expert[prefix + "2.down_proj.weight"], base[prefix + "down_proj"][2])
    with pytest.raises(KeyError, match=r"experts\.9\.gate_proj"):
        weights.get(prefix + "9.gate_proj.weight")  # the fused tensor holds 3
    # The trainer's export (per expert, in any order, the norm changed) in the base's form: the experts
    # fused again bit for bit, the kept tensors added unchanged, nothing else.
    changed_norm = base["model.language_model.norm.weight"] + 1
    export = [("model.language_model.norm.weight", changed_norm), *reversed(per_expert.items())]
    written = dict(in_base_form(export, weights, experts, ("model.visual.", "mtp.")))
    assert sorted(written) == sorted(base)
    for name in (
        prefix + "gate_up_proj",
        prefix + "down_proj",
        "model.visual.merger.linear_fc1.weight",
        "mtp.fc.weight",
    ):
        assert torch.equal(written[name], base[name]), name
    assert torch.equal(written["model.language_model.norm.weight"], changed_norm)
    with pytest.raises(ValueError, match="incomplete"):
        list(in_base_form(export[:-1], weights, experts, ()))

"""In-process units: HF config mapping (dense, MoE and MLA families, refusals), the conversion through
mbridge (`tether.train.model.bridge`: name mapping for the local spec, TP 1/2/4 layouts, the TransformerConfig
with the HF facts mbridge drops, GLM-4 dense's bridge and layer spec), checkpoint selection on disk,
and the CPU patch switch."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.runtime.errors import ConfigError
from tether.train.checkpoint import load_save as checkpoint
from tether.train.model import bridge, megatron_cpu
from tether.train.model.hf_config import (
    DEEPSEEK_ROUTER_MODEL_TYPES,
    MLA_MODEL_TYPES,
    ModelArch,
    check_architecture_flags,
    check_model_name,
    check_parallel,
    load_arch,
)
from tether.train.model.mbridge_import import import_all
from tether.train.model.megatron_cpu import quiet_megatron_imports

with warnings.catch_warnings():
    # torch.compile machinery imported by megatron.core and mbridge warns about torch's own deprecations.
    warnings.simplefilter("ignore")
    with quiet_megatron_imports():
        import_all()
    import megatron.core.transformer.transformer_config  # noqa: F401

BASE = {
    "model_type": "qwen2",
    "vocab_size": 321,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def write_config(tmp: Path, **changes: object) -> Path:
    cfg = {**BASE, **changes}
    (tmp / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return tmp


def test_load_arch_maps_the_families(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path))
    assert (arch.qkv_bias, arch.qk_layernorm, arch.head_dim, arch.rope_theta) == (True, False, 8, 1e6)
    qwen3 = load_arch(write_config(tmp_path, model_type="qwen3", head_dim=16))
    assert (qwen3.qkv_bias, qwen3.qk_layernorm, qwen3.head_dim) == (False, True, 16)
    old_style = load_arch(write_config(tmp_path, model_type="llama", rope_parameters=None, rope_theta=5e5))
    assert old_style.rope_theta == 5e5 and old_style.rope_scaling_factor is None
    llama3 = load_arch(
        write_config(
            tmp_path,
            model_type="llama",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 32.0,
                "low_freq_factor": 1.0,
            },
        )
    )
    assert llama3.rope_scaling_factor == 32.0


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
        (
            {
                "model_type": "deepseek_v3",
                "n_routed_experts": 8,
                "num_experts_per_tok": 4,
                "n_group": 4,
                "topk_group": 1,
                "moe_intermediate_size": 8,
                "kv_lora_rank": 8,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4,
                "v_head_dim": 8,
            },
            "topk_group",
        ),
        (
            {
                "model_type": "glm4_moe",
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 8,
                "norm_topk_prob": False,
            },
            "norm_topk_prob",
        ),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_load_arch_names_the_bad_field(tmp_path: Path, changes: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_arch(write_config(tmp_path, **changes))


GLM4 = {
    "model_type": "glm4",
    "head_dim": 8,
    "pad_token_id": 0,
    "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
}


def test_load_arch_reads_glm4_dense(tmp_path: Path) -> None:
    # Without attention_bias / partial_rotary_factor in config.json, transformers' Glm4Config defaults
    # apply (q/k/v biases, half the head dim rotated); the sandwich norms and interleaved RoPE always.
    glm = load_arch(write_config(tmp_path, **GLM4))
    assert (glm.qkv_bias, glm.rotary_percent, glm.rotary_interleaved, glm.post_sublayer_norms) == (
        True,
        0.5,
        True,
        True,
    )
    assert not glm.is_moe
    params = {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.25}
    other = load_arch(write_config(tmp_path, **{**GLM4, "attention_bias": False, "rope_parameters": params}))
    assert (other.qkv_bias, other.rotary_percent) == (False, 0.25)
    for family in ("qwen2", "glm4_moe"):
        arch = load_arch(write_config(tmp_path, model_type=family, **MOE.get(family, {})))
        assert not arch.rotary_interleaved and not arch.post_sublayer_norms


def test_glm4_architecture_flags_must_match(tmp_path: Path) -> None:
    glm = load_arch(write_config(tmp_path, **GLM4))
    # slime's scripts/models/glm4-9B.sh, shaped to this config.
    check_architecture_flags(
        glm,
        {
            "post_self_attn_layernorm": True,
            "post_mlp_layernorm": True,
            "rotary_interleaved": True,
            "rotary_percent": 0.5,
            "add_qkv_bias": True,
        },
    )
    with pytest.raises(
        ConfigError, match=r"--rotary-percent=1\.0: the Hugging Face config \(glm4\) has 0\.5"
    ):
        check_architecture_flags(glm, {"rotary_percent": 1.0})
    qwen = load_arch(write_config(tmp_path))
    for flag in ("post_self_attn_layernorm", "post_mlp_layernorm", "rotary_interleaved"):
        dashed = "--" + flag.replace("_", "-")
        with pytest.raises(
            ConfigError, match=f"{dashed}=True: the Hugging Face config \\(qwen2\\) has False"
        ):
            check_architecture_flags(qwen, {flag: True})


def test_missing_checkpoint_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        load_arch(tmp_path / "nope")


def test_parallel_and_architecture_flag_checks(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path))
    check_parallel(arch, 4, 2)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        check_parallel(arch, 8, 1)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        check_parallel(arch, 1, 3)
    check_architecture_flags(
        arch, {"num_layers": 4, "add_qkv_bias": True, "rotary_base": 1e6, "seq_length": 9}
    )
    with pytest.raises(ConfigError, match="--hidden-size=128"):
        check_architecture_flags(arch, {"hidden_size": 128})


MOE = {
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": False,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5},
    },
    "deepseek_v3": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "n_group": 4,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "num_key_value_heads": 8,
    },
    # GLM-4.7-Flash: DeepSeek-V3's attention (values wider than the query's nope part), GLM-4.5's
    # router with one group, the dense layers as mlp_layer_types only (mbridge reads
    # first_k_dense_replace: bridge.hf_config derives it), an MTP layer.
    "glm4_moe_lite": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 16,
        "num_key_value_heads": 8,
        "rope_interleave": True,
        "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        "num_nextn_predict_layers": 1,
    },
    # Kimi-K2: DeepSeek-V3's config.json (rope_scaling with `type`, rope_theta beside it) under
    # its own model_type, one expert group.
    "kimi_k2": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 0,
        "rope_parameters": None,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


def test_load_arch_reads_the_moe_and_mla_families(tmp_path: Path) -> None:
    qwen3 = load_arch(write_config(tmp_path, model_type="qwen3_moe", **MOE["qwen3_moe"]))
    # decoder_sparse_step 2: layers 1 and 3 are MoE, and mlp_only_layers makes 3 dense again.
    assert (qwen3.num_experts, qwen3.moe_router_topk, qwen3.moe_layer_freq) == (4, 2, (0, 1, 0, 0))
    assert (qwen3.qk_layernorm, qwen3.moe_router_pre_softmax, qwen3.moe_shared_expert_gate) == (
        True,
        False,
        False,
    )
    qwen2 = load_arch(write_config(tmp_path, model_type="qwen2_moe", **MOE["qwen2_moe"]))
    assert (qwen2.moe_router_pre_softmax, qwen2.moe_shared_expert_gate, qwen2.qkv_bias) == (True, True, True)
    assert qwen2.moe_shared_expert_intermediate_size == 32
    mixtral = load_arch(write_config(tmp_path, model_type="mixtral", **MOE["mixtral"]))
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_router_pre_softmax) == (
        4,
        96,
        False,
    )
    glm = load_arch(write_config(tmp_path, model_type="glm4_moe", **MOE["glm4_moe"]))
    assert (glm.rotary_percent, glm.qkv_bias, glm.qk_layernorm, glm.moe_layer_freq) == (
        0.5,
        True,
        True,
        (0, 1, 1, 1),
    )
    assert (glm.moe_router_score_function, glm.moe_router_enable_expert_bias, glm.moe_router_num_groups) == (
        "sigmoid",
        True,
        None,
    )
    assert (glm.moe_shared_expert_intermediate_size, glm.moe_router_topk_scaling_factor) == (32, 1.5)
    ds = load_arch(write_config(tmp_path, model_type="deepseek_v3", **MOE["deepseek_v3"]))
    assert ds.multi_latent_attention and (ds.q_lora_rank, ds.kv_lora_rank, ds.v_head_dim) == (32, 16, 8)
    assert (ds.qk_head_dim, ds.qk_pos_emb_head_dim, ds.head_dim) == (8, 4, 12)
    assert (ds.moe_router_num_groups, ds.moe_router_group_topk, ds.moe_layer_freq) == (4, 1, (0, 0, 1, 1))
    assert ds.yarn is None
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    ds_yarn = load_arch(
        write_config(tmp_path, model_type="deepseek_v3", **{**MOE["deepseek_v3"], "rope_parameters": yarn})
    )
    assert dict(ds_yarn.yarn or ()) == {
        "rotary_scaling_factor": 40.0,
        "original_max_position_embeddings": 4096.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def test_kimi_k2_reads_as_the_deepseek_v3_config_it_is(tmp_path: Path) -> None:
    """Kimi-K2's config.json is DeepSeek-V3's under model_type kimi_k2: the same architecture,
    YaRN from its `rope_scaling` included; only the family name differs."""
    kimi = load_arch(write_config(tmp_path, model_type="kimi_k2", **MOE["kimi_k2"]))
    ds = load_arch(write_config(tmp_path, model_type="deepseek_v3", **MOE["kimi_k2"]))
    assert kimi.model_type == "kimi_k2" and dataclasses.replace(kimi, model_type="deepseek_v3") == ds
    assert kimi.multi_latent_attention and kimi.rope_theta == 50000.0 and kimi.moe_router_num_groups is None
    assert dict(kimi.yarn or ())["rotary_scaling_factor"] == 32.0 and kimi.moe_layer_freq == (0, 1, 1, 1)


@pytest.mark.parametrize(
    ("layers", "want"),
    [
        ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, (0, 1, 0, 1)),
        # mlp_layer_types wins over first_k_dense_replace (transformers reads only the list).
        (
            {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "first_k_dense_replace": 3},
            (0, 1, 0, 1),
        ),
        # GLM-4.7-Flash's published config.json: first_k_dense_replace 1 (and the same list when saved
        # by transformers); without either, transformers' default: layer 0 dense.
        ({"first_k_dense_replace": 1}, (0, 1, 1, 1)),
        ({}, (0, 1, 1, 1)),
    ],
)
def test_glm4_moe_lite_dense_layers(tmp_path: Path, layers: dict[str, object], want: tuple[int, ...]) -> None:
    base = {k: v for k, v in MOE["glm4_moe_lite"].items() if k != "mlp_layer_types"}
    arch = load_arch(write_config(tmp_path, model_type="glm4_moe_lite", **base, **layers))
    assert arch.moe_layer_freq == want and arch.mtp_layers == 1
    assert arch.multi_latent_attention and arch.qk_layernorm and not arch.qkv_bias
    assert (arch.qk_head_dim, arch.v_head_dim, arch.head_dim) == (8, 16, 12)


@pytest.mark.parametrize(
    ("family", "changes", "key"),
    [
        ("glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
        ("glm4_moe_lite", {"mlp_layer_types": None, "first_k_dense_replace": 2}, "first_k_dense_replace"),
        ("glm4_moe_lite", {"attention_bias": True}, "attention_bias"),
        ("glm4_moe_lite", {"rope_interleave": False}, "rope_interleave"),
        ("glm4_moe_lite", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("kimi_k2", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ],
)
def test_mla_families_name_what_megatron_cannot_build(
    tmp_path: Path, family: str, changes: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_arch(write_config(tmp_path, model_type=family, **{**MOE[family], **changes}))
    assert err.value.key.endswith(f"config.json:{key}"), err.value


@pytest.mark.parametrize(
    "quantization_config",
    [
        # slime's tools/convert_hf_to_int4_direct.py (its INT4 scripts' checkpoints)
        {
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"group_size": 128, "num_bits": 4, "strategy": "group", "type": "int"},
                }
            },
            "format": "pack-quantized",
            "quant_method": "compressed-tensors",
        },
        # DeepSeek-V3/R1's and Qwen3-*-FP8's block FP8
        {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    ],
)
def test_load_arch_refuses_a_quantized_checkpoint(
    tmp_path: Path, quantization_config: dict[str, Any]
) -> None:
    """Engines serving a quantized checkpoint expect quantized weights; tether syncs unquantized ones
    and does not quantize them as slime does, so the checkpoint is refused, naming the key and method."""
    with pytest.raises(ConfigError) as err:
        load_arch(write_config(tmp_path, quantization_config=quantization_config))
    assert err.value.key.endswith("config.json:quantization_config"), err.value
    assert quantization_config["quant_method"] in str(err.value)
    assert "does not quantize" in str(err.value)
    load_arch(write_config(tmp_path))  # the same config unquantized


def test_model_name_picks_the_converter_slime_would(tmp_path: Path) -> None:
    """--model-name, matched as slime matches it: GLM-4.7-Flash and Kimi-K2 take DeepSeek-V3's
    converter (so any of its names, slime's default from the config class included), and a GLM-4.5
    checkpoint refuses a name slime would send there."""
    lite = load_arch(write_config(tmp_path, model_type="glm4_moe_lite", **MOE["glm4_moe_lite"]))
    kimi = load_arch(write_config(tmp_path, model_type="kimi_k2", **MOE["kimi_k2"]))
    glm45 = load_arch(write_config(tmp_path, model_type="glm4_moe", **MOE["glm4_moe"]))
    for arch, good, bad in (
        (lite, ["glm4_moe_lite", "glm4moeliteconfig", "deepseekv3"], ["glm4_moe", "GLM-4.7-Flash", "qwen3"]),
        (kimi, ["kimi-k2", "Kimi-K2-Thinking", "deepseekv3config"], ["qwen3_moe", "glm4_moe"]),
        (glm45, ["glm4_moe", "glm4moeconfig"], ["glm4_moe_lite", "deepseekv3"]),
    ):
        for name in good:
            check_model_name(arch, name)
        for name in bad:
            with pytest.raises(ConfigError, match="--model-name"):
                check_model_name(arch, name)


def test_mla_families_ignore_add_qkv_bias(tmp_path: Path) -> None:
    """slime's GLM-4.7-Flash script passes --add-qkv-bias with --multi-latent-attention: MLA has no
    q/k/v projections (Megatron never reads the flag there), so it is not held against
    attention_bias; where the attention has q/k/v projections it still is."""
    lite = load_arch(write_config(tmp_path, model_type="glm4_moe_lite", **MOE["glm4_moe_lite"]))
    check_architecture_flags(lite, {"add_qkv_bias": True, "multi_latent_attention": True})
    check_architecture_flags(lite, {"add_qkv_bias": False})
    qwen3 = load_arch(write_config(tmp_path, model_type="qwen3_moe", **MOE["qwen3_moe"]))
    with pytest.raises(ConfigError, match="--add-qkv-bias=True"):
        check_architecture_flags(qwen3, {"add_qkv_bias": True})


def test_moe_layouts_are_checked(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path, model_type="qwen3_moe", **MOE["qwen3_moe"]))
    check_parallel(arch, 2, 2, ep_size=4)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size=3"):
        check_parallel(arch, 1, 1, ep_size=3)
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size=3"):
        check_parallel(arch, 1, 1, etp_size=3)
    dense = load_arch(write_config(tmp_path))
    with pytest.raises(ConfigError, match="no experts"):
        check_parallel(dense, 1, 1, ep_size=2)
    check_architecture_flags(arch, {"num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": "[0,1,0,0]"})
    with pytest.raises(ConfigError, match="--num-experts=8"):
        check_architecture_flags(arch, {"num_experts": 8})
    with pytest.raises(ConfigError, match="--moe-layer-freq='1'"):
        check_architecture_flags(arch, {"moe_layer_freq": "1"})
    with pytest.raises(ConfigError, match="--multi-latent-attention=True"):
        check_architecture_flags(arch, {"multi_latent_attention": True})


def test_te_names_map_the_local_spec(tmp_path: Path) -> None:
    ds = load_arch(write_config(tmp_path, model_type="deepseek_v3", **MOE["deepseek_v3"]))
    dense = load_arch(write_config(tmp_path))
    moe_layers = {3}
    cases = [
        (
            dense,
            "decoder.layers.3.input_layernorm.weight",
            "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
        ),
        (
            dense,
            "decoder.layers.2.pre_mlp_layernorm.weight",
            "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        ),
        (ds, "decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.3.pre_mlp_layernorm.weight"),
        (ds, "decoder.layers.3.input_layernorm.weight", "decoder.layers.3.input_layernorm.weight"),
        (
            ds,
            "decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
        ),
        (
            ds,
            "decoder.layers.0.self_attention.kv_layernorm.weight",
            "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
        ),
        (
            ds,
            "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight",
            "decoder.layers.3.mlp.experts.linear_fc2.weight5",
        ),
        (
            ds,
            "decoder.layers.3.mlp.experts.linear_fc1.weight0",
            "decoder.layers.3.mlp.experts.linear_fc1.weight4",
        ),
        (ds, "embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ]
    for arch, local, want in cases:
        assert bridge.te_name(local, arch, moe_layers, expert_offset=4) == want, local


def _open(hf_dir: Path, tp: int = 1) -> tuple[ModelArch, Any]:
    arch = load_arch(hf_dir)
    return arch, bridge.open_bridge(
        arch,
        bridge.hf_config(hf_dir),
        dtype=torch.float32,
        parallel=bridge.parallel_states(tp_size=tp, pp_size=1),
    )


def _weights(arch: ModelArch, b: Any, tp: int) -> bridge.WeightBridge:
    fields = bridge.config_kwargs(dict(b.config), arch, {"tensor_model_parallel_size": tp})
    return bridge.WeightBridge(arch, b, arch.padded_vocab_size(tp), bridge.build_config(arch, fields))


def _marked(shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    t = torch.empty(shape)
    if dim is not None:
        t.tensor_model_parallel = True  # type: ignore[attr-defined]
        t.partition_dim = dim  # type: ignore[attr-defined]
    return t


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_conversion_round_trips_bit_exact(tmp_path: Path, tp: int) -> None:
    """HF tensors → Megatron layout (mbridge) → TP shards → merged → HF tensors, per kind of weight."""
    hf_dir = write_config(tmp_path, model_type="deepseek_v3", **MOE["deepseek_v3"])
    arch, b = _open(hf_dir, tp)
    weights = _weights(arch, b, tp)
    g = torch.Generator().manual_seed(tp)
    h, f, e = arch.hidden_size, arch.ffn_hidden_size, arch.moe_ffn_hidden_size or 0
    heads = arch.num_attention_heads
    cases: list[tuple[str, list[tuple[int, ...]], int | None]] = [
        ("embedding.word_embeddings.weight", [(arch.vocab_size, h)], 0),
        ("decoder.layers.0.mlp.linear_fc1.weight", [(f, h), (f, h)], 0),
        ("decoder.layers.0.mlp.linear_fc2.weight", [(h, f)], 1),
        ("decoder.layers.3.mlp.experts.linear_fc1.weight7", [(e, h), (e, h)], 0),
        ("decoder.layers.3.mlp.experts.linear_fc2.weight7", [(h, e)], 1),
        ("decoder.layers.3.mlp.router.weight", [(8, h)], None),
        ("decoder.layers.3.mlp.router.expert_bias", [(8,)], None),
        ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", [(heads * 16, 16)], 0),
        ("decoder.layers.1.self_attention.linear_q_up_proj.weight", [(heads * 12, 32)], 0),
        ("decoder.layers.1.self_attention.linear_proj.weight", [(h, heads * 8)], 1),
        ("decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight", [(16,)], None),
    ]
    for name, shapes, dim in cases:
        hf = [torch.randn(s, generator=g) for s in shapes]
        full = b._weight_to_mcore_format(name, hf)  # type: ignore[attr-defined]
        shard_shape = list(full.shape)
        if dim is not None:
            shard_shape[dim] //= tp
        param = _marked(tuple(shard_shape), dim)
        shards = list(b._weight_split_across_tp(name, full, param, tp))  # type: ignore[attr-defined]
        assert all(tuple(s.shape) == tuple(param.shape) for s in shards), name
        merged = b._weight_merge_across_tp(name, shards, param) if dim is not None and tp > 1 else shards[0]  # type: ignore[attr-defined]
        names, back = b._weight_to_hf_format(name, merged)  # type: ignore[attr-defined]
        assert names == weights.hf_names(name)
        for want, got in zip(hf, back, strict=True):
            assert torch.equal(want, got), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glm4_bridge_maps_fused_gate_up_and_sandwich_norms(tmp_path: Path, tp: int) -> None:
    """GLM-4's gate_up_proj is Megatron's fused fc1 ([gate; up]): each TP rank gets its gate rows and
    its up rows, and the merge gives the HF tensor back bit-exact; the two extra norms keep their names."""
    arch, b = _open(write_config(tmp_path, **GLM4), tp)
    weights = _weights(arch, b, tp)
    layer = "model.layers.2."
    assert weights.hf_names("decoder.layers.2.mlp.linear_fc1.weight") == [layer + "mlp.gate_up_proj.weight"]
    assert weights.hf_names("decoder.layers.2.mlp.linear_fc1.layer_norm_weight") == [
        layer + "post_attention_layernorm.weight"
    ]
    assert weights.hf_names("decoder.layers.2.post_mlp_layernorm.weight") == [
        layer + "post_mlp_layernorm.weight"
    ]
    assert weights.hf_names("decoder.layers.2.post_self_attn_layernorm.weight") == [
        layer + "post_self_attn_layernorm.weight"
    ]
    assert weights.hf_names("decoder.layers.2.self_attention.linear_qkv.bias") == [
        layer + f"self_attn.{p}_proj.bias" for p in "qkv"
    ]
    f, h = arch.ffn_hidden_size, arch.hidden_size
    gate_up = torch.arange(2 * f * h, dtype=torch.float32).view(2 * f, h)
    name = "decoder.layers.2.mlp.linear_fc1.weight"
    full = b._weight_to_mcore_format(name, [gate_up])  # type: ignore[attr-defined]
    param = _marked((2 * f // tp, h), 0)
    shards = list(b._weight_split_across_tp(name, full, param, tp))  # type: ignore[attr-defined]
    rows = f // tp
    for rank, shard in enumerate(shards):
        want = torch.cat(
            [gate_up[rank * rows : (rank + 1) * rows], gate_up[f + rank * rows : f + (rank + 1) * rows]]
        )
        assert torch.equal(shard, want)
    merged = b._weight_merge_across_tp(name, shards, param) if tp > 1 else shards[0]  # type: ignore[attr-defined]
    names, back = b._weight_to_hf_format(name, merged)  # type: ignore[attr-defined]
    assert names == [layer + "mlp.gate_up_proj.weight"] and torch.equal(back[0], gate_up)
    config = weights.config  # mbridge's kwargs with the restored HF facts
    assert config.rotary_interleaved and config.add_qkv_bias and not config.add_bias_linear


def test_glm4_layers_carry_the_output_norms_under_both_specs(tmp_path: Path) -> None:
    """Local spec: the two norms are sequence-parallel torch norms on Megatron's TransformerLayer
    subclass. TE spec (not buildable without TransformerEngine): they take the block's norm class
    (TENorm there), checked on a stand-in block."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from tether.train.model import spec as bridge_spec
    from tether.train.model.families import glm4 as bridge_glm4

    arch, b = _open(write_config(tmp_path, **GLM4), 2)
    fields = bridge.config_kwargs(
        dict(b.config), arch, {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    )
    config = bridge.build_config(arch, fields)
    block = bridge.layer_spec(config, transformer_engine=False, pp_rank=0, post_sublayer_norms=True)
    for layer in block.layer_specs:
        assert layer.module is bridge_glm4.post_norm_layer_class()
        assert issubclass(layer.module, TransformerLayer)
        assert layer.submodules.post_self_attn_layernorm is bridge_spec.SequenceParallelTorchNorm
        assert layer.submodules.post_mlp_layernorm is bridge_spec.SequenceParallelTorchNorm
    plain = bridge.layer_spec(config, transformer_engine=False, pp_rank=0)
    assert all(layer.module is TransformerLayer for layer in plain.layer_specs)

    class StandInNorm:
        pass

    te_like = TransformerBlockSubmodules(
        layer_specs=[
            ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=StandInNorm))
        ],
        layer_norm=StandInNorm,
    )
    layer = bridge_glm4.with_post_sublayer_norms(te_like).layer_specs[0]
    assert layer.submodules.post_self_attn_layernorm is StandInNorm
    assert layer.submodules.post_mlp_layernorm is StandInNorm
    assert layer.submodules.mlp is StandInNorm  # the other submodules are kept


def test_qkv_layout_groups_query_heads_with_their_kv_head(tmp_path: Path) -> None:
    hf_dir = write_config(
        tmp_path, model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, hidden_size=8, head_dim=2
    )
    _, b = _open(hf_dir)
    d = 2
    q = torch.arange(4 * d).float().view(4 * d, 1).expand(4 * d, 8)
    k = 100 + torch.arange(2 * d).float().view(2 * d, 1).expand(2 * d, 8)
    v = 200 + torch.arange(2 * d).float().view(2 * d, 1).expand(2 * d, 8)
    rows = b._weight_to_mcore_format("decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v])[
        :, 0
    ].tolist()  # type: ignore[attr-defined]
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise
    assert rows == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_tied_output_layer_reads_the_embedding(tmp_path: Path) -> None:
    for tied, want in ((True, ["model.embed_tokens.weight"]), (False, ["lm_head.weight"])):
        hf_dir = write_config(tmp_path, model_type="qwen2", tie_word_embeddings=tied)
        arch, b = _open(hf_dir)
        assert _weights(arch, b, 1).hf_names("output_layer.weight") == want


@pytest.mark.parametrize("family", sorted(MOE))
def test_transformer_config_restores_what_mbridge_drops(tmp_path: Path, family: str) -> None:
    hf_dir = write_config(tmp_path, model_type=family, **MOE[family])
    arch, b = _open(hf_dir)
    fields = bridge.config_kwargs(dict(b.config), arch, {"tensor_model_parallel_size": 1})  # type: ignore[attr-defined]
    config = bridge.build_config(arch, fields)
    assert config.num_moe_experts == arch.num_experts and config.moe_router_topk == 2
    assert config.moe_layer_freq == list(arch.moe_layer_freq or ())
    # Dropped or different in mbridge 0.15.1's configs: normalization of the top-k weights, the
    # shared expert's gate, grouped routing, the attention bias, partial RoPE, the dense layers.
    assert config.moe_router_pre_softmax == arch.moe_router_pre_softmax
    assert config.moe_shared_expert_gate == (family == "qwen2_moe")
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (
        (4, 1) if family == "deepseek_v3" else (None, None)
    )
    assert config.add_qkv_bias == (family in ("qwen2_moe", "glm4_moe"))
    assert config.moe_router_enable_expert_bias == (family in DEEPSEEK_ROUTER_MODEL_TYPES)
    # TE/CUDA-only settings mbridge asks for are off; knobs come from the flags (Megatron's defaults).
    assert not config.moe_grouped_gemm and not config.persist_layer_norm and not config.sequence_parallel
    assert (
        config.moe_router_load_balancing_type == "aux_loss"
        and config.moe_token_dispatcher_type == "allgather"
    )
    assert config.multi_latent_attention == (family in MLA_MODEL_TYPES)
    assert config.mtp_num_layers is None
    if family == "kimi_k2":  # YaRN from rope_scaling, which mbridge 0.15.1 does not find in transformers 5
        assert (config.rope_type, config.rotary_scaling_factor, config.rotary_base) == ("yarn", 32.0, 50000.0)
        assert (config.beta_fast, config.beta_slow) == (1.0, 1.0)
    if family == "glm4_moe_lite":
        assert config.v_head_dim == 16 and config.moe_router_topk_scaling_factor == 1.8
        assert config.rope_type == "rope"


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> None:
    d = root / checkpoint.iter_dir_name(step)
    (d / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    if complete:
        (d / checkpoint.RUN_STATE).write_bytes(b"\x80")


def test_find_checkpoint_skips_incomplete_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert checkpoint.find_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / "iter_0000003.tmp" / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000002"  # no `latest`: newest complete
    (tmp_path / checkpoint.LATEST).write_text("1")
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000001"
    _fake_checkpoint(tmp_path, 4, complete=False)
    (tmp_path / checkpoint.LATEST).write_text("4")
    with caplog.at_level("WARNING"):
        assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000002"
    assert "no complete checkpoint" in caplog.text
    assert checkpoint.complete_checkpoints(tmp_path) == [1, 2]


def test_cpu_patches_follow_cuda_availability() -> None:
    assert megatron_cpu.needed() == (not torch.cuda.is_available())


def test_local_spec_runs_what_te_spec_runs(tmp_path: Path) -> None:
    """The local spec's norms accept sequence parallelism; MLA gets a core attention taking its head
    dims and a replicated kv down-projection (see tether.train.model.spec)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from tether.train.model import spec as bridge_spec

    hf_dir = write_config(tmp_path, model_type="deepseek_v3", **MOE["deepseek_v3"])
    arch, b = _open(hf_dir, 2)
    fields = bridge.config_kwargs(
        dict(b.config), arch, {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    )
    config = bridge.build_config(arch, fields)
    layer = bridge.layer_spec(config, transformer_engine=False, pp_rank=0).layer_specs[0]
    attention = layer.submodules.self_attention.submodules
    assert layer.submodules.input_layernorm is bridge_spec.SequenceParallelTorchNorm
    assert attention.q_layernorm is bridge_spec.SequenceParallelTorchNorm
    assert attention.core_attention.__name__ == "MLADotProductAttention"
    assert attention.linear_kv_down_proj is Linear
    assert WrappedTorchNorm not in (layer.submodules.pre_mlp_layernorm, attention.kv_layernorm)
    norm = bridge_spec.SequenceParallelTorchNorm(config, hidden_size=16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())  # summed over TP by finalize_model_grads

"""Hugging Face config.json → the architecture tether builds in Megatron.

`ModelArch` is read from config.json directly (no transformers or torch import: the head checks a
plan with it before anything starts) and holds the facts callers need: vocabulary and its padding,
tied embeddings, layers, attention shape, MoE routing and multi-latent attention. The Megatron
`TransformerConfig` itself comes from mbridge through `tether.train.model.bridge`. Both rope layouts are
accepted: transformers 5 (`rope_parameters`) and earlier (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError
from tether.train.config import stage_layers

# mimo: Qwen2 plus multi-token-prediction layers (built with --mtp-num-layers: tether.train.model.mtp).
# qwen3_5 / qwen3_5_moe: Qwen3-Next's decoder with linear attention's projections apart (in_proj_qkv,
# in_proj_z, in_proj_b, in_proj_a), dense or MoE, published as vision-language checkpoints whose
# language model sits under text_config (tether.train.model.families.qwen3_5).
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "glm4", "mimo", "qwen3_5")
# DeepSeek sparse attention (DSA): DeepSeek-V3's decoder with an indexer choosing each query's keys
# (GLM-5, DeepSeek-V3.2; tether.train.model.families.dsa).
DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
# DeepSeek-V3's decoder (multi-latent attention, its sigmoid router, shared experts, dense first
# layers) under three names: GLM-4.7-Flash and Kimi-K2 (whose config.json is DeepSeek-V3's), as slime
# loads and converts all three with its DeepSeek code; and the sparse-attention families on it.
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "kimi_k2", *DSA_MODEL_TYPES)
# qwen3_next: Qwen2-MoE's experts under gated full attention and gated-DeltaNet linear attention
# (tether.train.model.families.qwen3_next).
MOE_MODEL_TYPES = (
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "minimax_m2",
    *MLA_MODEL_TYPES,
    "qwen3_next",
    "qwen3_5_moe",
)
# Qwen-MoE routing (softmax, norm_topk_prob) and layer choice (decoder_sparse_step, mlp_only_layers).
QWEN_MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe")
# Gated-DeltaNet linear attention between gated full-attention layers, zero-centred norms.
GATED_DELTANET_MODEL_TYPES = ("qwen3_next", *QWEN3_5_MODEL_TYPES)
# Text-only checkpoints of a family published with a vision tower (transformers' *ForCausalLM).
TEXT_ONLY_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
# Families whose checkpoints carry multi-token-prediction layers (num_nextn_predict_layers):
# MiMo's under model.mtp_layers.{i}, DeepSeek-V3's (and its kin's) and GLM-4.5's as model.layers.{L + i}.
MTP_MODEL_TYPES = ("mimo", "glm4_moe", *MLA_MODEL_TYPES)
# Families routed as DeepSeek-V3 routes: sigmoid scores, a selection bias, groups, scaled weights.
DEEPSEEK_ROUTER_MODEL_TYPES = ("glm4_moe", *MLA_MODEL_TYPES)

MINIMAX_M2_SPEC = "slime_plugins.models.minimax_m2"
"""slime's layer-spec module for MiniMax-M2 (full QK norms): accepted for that family only."""
QWEN3_NEXT_SPEC = "slime_plugins.models.qwen3_next"
"""slime's layer-spec module for Qwen3-Next (gated-DeltaNet linear attention): that family only."""
QWEN3_5_SPEC = "slime_plugins.models.qwen3_5"
"""slime's layer-spec module for Qwen3.5 (dense and MoE): those families only."""
GLM5_SPEC = "slime_plugins.models.glm5.glm5"
"""slime's layer-spec module for GLM-5 (MLA with the DSA indexer), which slime's DeepSeek-V3.2 runs
use too: the sparse-attention families."""
# slime's family-specific layer-spec modules: the families whose layers they build, and their name.
_FAMILY_SPECS: dict[str, tuple[tuple[str, ...], str]] = {
    MINIMAX_M2_SPEC: (("minimax_m2",), "MiniMax-M2"),
    QWEN3_NEXT_SPEC: (("qwen3_next",), "Qwen3-Next"),
    QWEN3_5_SPEC: (QWEN3_5_MODEL_TYPES, "Qwen3.5"),
    GLM5_SPEC: (DSA_MODEL_TYPES, "GLM-5 / DeepSeek-V3.2 sparse attention"),
}

# Families a user may expect but that cannot be built exactly; the reason is the refusal's text.
# (GLM-4 dense was here until its sandwich norms were built: tether.train.model.families.glm4.)
REFUSED_MODEL_TYPES: dict[str, str] = {}

# Megatron's llama3 RoPE scaling hard-codes these; other values cannot be represented.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# YaRN parameters of multi-latent attention (DeepSeek), under their Megatron MLATransformerConfig names.
_YARN_KEYS = {
    "factor": "rotary_scaling_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}


@dataclass(frozen=True)
class ModelArch:
    """A decoder's shape, in HF terms: enough to build it in Megatron, check flags and plans against it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling_factor: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    vocab_multiple: int = 1
    """--make-vocab-size-divisible-by: embedding rows are padded to a multiple of this times TP."""
    rotary_percent: float = 1.0
    """Share of the head dim that RoPE rotates (GLM's partial_rotary_factor)."""
    rotary_interleaved: bool = False
    """RoPE rotates adjacent pairs (GLM-4 dense: Megatron's --rotary-interleaved), not the two halves."""
    qk_norm_full: bool = False
    """The q and k norms span all heads (MiniMax-M2's q_norm/k_norm), not one head:
    tether.train.model.families.minimax_m2."""
    post_sublayer_norms: bool = False
    """GLM-4 dense's sandwich norms: attention's and the MLP's outputs are normalized again before
    the residual add (HF post_self_attn_layernorm / post_mlp_layernorm; Megatron's
    --post-self-attn-layernorm / --post-mlp-layernorm)."""
    # Mixture of experts (num_experts None: dense).
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate on the shared expert's output."""
    moe_layer_freq: tuple[int, ...] | None = None
    """Per layer: 1 for an MoE layer, 0 for a dense one."""
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k (no renormalization): HF's norm_topk_prob=False."""
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    """The router holds a per-expert bias for selection (HF's e_score_correction_bias)."""
    # Multi-latent attention (DeepSeek).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    yarn: tuple[tuple[str, float], ...] | None = None
    """MLA's YaRN rope scaling, as (MLATransformerConfig field, value) pairs; None: plain RoPE."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds (num_nextn_predict_layers; MTP_MODEL_TYPES)."""
    # Qwen3-Next (tether.train.model.families.qwen3_next).
    linear_attention: tuple[int, ...] | None = None
    """Per layer 1 where the token mixer is gated-DeltaNet linear attention, 0 where it is full
    attention (HF layer_types; Megatron's linear_attention_freq). None: full attention throughout."""
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    attention_output_gate: bool = False
    """q_proj also yields a sigmoid gate per head on attention's output (Megatron's
    attention_output_gate, slime's --attention-output-gate)."""
    zero_centered_norms: bool = False
    """RMSNorms scale by 1 + weight (Megatron's layernorm_zero_centered_gamma, --apply-layernorm-1p)."""
    linear_attention_split: bool = False
    """Linear attention's input projections are four HF tensors (Qwen3.5's in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a), not Qwen3-Next's two grouped per key head."""
    hf_prefix: str = "model."
    """Where the decoder's tensors sit in the HF checkpoint: `model.`, or `model.language_model.` in
    a checkpoint published with a vision tower (Qwen3.5's, config under text_config)."""
    hf_kept_prefixes: tuple[str, ...] = ()
    """HF tensors the trainer does not hold (a vision tower, MTP modules it does not build): kept as
    the base checkpoint has them and written back with every HF checkpoint tether saves."""
    # DeepSeek sparse attention (DSA_MODEL_TYPES; tether.train.model.families.dsa).
    index_heads: int | None = None
    """The indexer's query heads (index_n_heads); None: dense attention."""
    index_head_dim: int | None = None
    index_topk: int | None = None
    """Keys each query attends to (index_topk), chosen by the indexer's scores."""
    index_rope_interleaved: bool = True
    """The indexer rotates interleaved pairs (GLM-5) or halves (DeepSeek-V3.2) of its RoPE dims."""
    index_shared: tuple[bool, ...] | None = None
    """Per layer True where it has no indexer and reuses the previous computing layer's choice
    (GLM-5's indexer_types "shared")."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocab rounded up to a multiple of `vocab_multiple` x TP (rows split evenly on TP).

        By default only TP divisibility is required; padding further (Megatron-LM's 128) adds
        logits that real tokens' softmax excludes (`step.mask_padded_vocab`).
        """
        multiple = self.vocab_multiple * tp_size
        return -(-self.vocab_size // multiple) * multiple


def _field(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise ConfigError(f"{path}:{key}", None, "missing from the Hugging Face config")
    return cfg[key]


def _first(cfg: dict[str, Any], path: Path, *keys: str) -> Any:
    """The first of `keys` present (transformers renamed some fields between versions)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ConfigError(f"{path}:{keys[0]}", None, "missing from the Hugging Face config")


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, float | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3" and cfg.get("model_type") == "llama":
        source = params if params.get("rope_type") == "llama3" else scaling
        for key, want in _LLAMA3_FIXED.items():
            if key in source and float(source[key]) != want:
                raise ConfigError(
                    f"{path}:rope {key}", source[key], f"Megatron's llama3 RoPE supports only {want}"
                )
        return float(theta), float(source.get("factor", 8.0))
    if rope_type == "yarn" and cfg.get("model_type") in MLA_MODEL_TYPES:
        return float(theta), None  # read by _yarn
    raise ConfigError(
        f"{path}:rope_type",
        rope_type,
        f"supported: default, llama3 (llama), yarn ({', '.join(MLA_MODEL_TYPES)})",
    )


def _yarn(cfg: dict[str, Any]) -> tuple[tuple[str, float], ...] | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (params.get("rope_type") or params.get("type")) != "yarn":
        return None
    return tuple((field, float(params[key])) for key, field in _YARN_KEYS.items() if key in params)


MINIMAX_M2_FIXED: dict[str, object] = {
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
}
"""MiniMax-M2's config.json keys for what transformers' MiniMaxM2 always does (sigmoid routing with
a correction bias, QK norms over all heads); a checkpoint that says otherwise is not that model."""


def check_minimax_m2_keys(cfg: dict[str, Any], path: str | Path) -> None:
    for key, want in MINIMAX_M2_FIXED.items():
        if key in cfg and cfg[key] != want:
            raise ConfigError(
                f"{path}:{key}",
                cfg[key],
                f"MiniMax-M2 as transformers builds it has {want!r}; nothing else is built",
            )
    attn_types = cfg.get("attn_type_list")
    if isinstance(attn_types, list) and any(t != 1 for t in attn_types):
        raise ConfigError(
            f"{path}:attn_type_list", attn_types, "only full attention (1) in every layer is built"
        )


def check_model_type(model_type: object, path: str | Path) -> str:
    """The family, or a refusal naming why it cannot be built (at plan time and on the ranks)."""
    if model_type in REFUSED_MODEL_TYPES:
        raise ConfigError(f"{path}:model_type", model_type, REFUSED_MODEL_TYPES[str(model_type)])
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in TEXT_ONLY_MODEL_TYPES:
        raise ConfigError(f"{path}:model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return str(model_type)


def check_unquantized(cfg: dict[str, Any], path: str | Path) -> None:
    """Refuse a quantized checkpoint (a config.json with `quantization_config`, such as the
    compressed-tensors INT4 and FP8 checkpoints slime's low-precision scripts serve): its engines
    load quantized weights, and tether's weight sync sends them the trainer's unquantized ones.
    slime quantizes each synced weight for the engines by that config (`quantize_params`); tether
    does not."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    raise ConfigError(
        f"{path}:quantization_config",
        {"quant_method": method},
        f"the checkpoint is quantized ({method}): tether syncs unquantized weights to the engines and "
        "does not quantize them for the engines (slime's int4/fp8 rollout quantization is not "
        "implemented); point --hf-checkpoint at the unquantized checkpoint",
    )


def _glm4_moe_lite_layers(cfg: dict[str, Any], path: Path, layers: int) -> tuple[int, ...]:
    """GLM-4.7-Flash's MoE layers as transformers' Glm4MoeLite builds them: `mlp_layer_types` when
    given (any pattern), else only layer 0 dense (first_k_dense_replace is not read there)."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        first_dense = cfg.get("first_k_dense_replace")
        if first_dense is not None and first_dense != 1:
            raise ConfigError(
                f"{path}:first_k_dense_replace",
                first_dense,
                "without mlp_layer_types transformers' Glm4MoeLite keeps only layer 0 dense; "
                "list the layers in mlp_layer_types",
            )
        return tuple(0 if i == 0 else 1 for i in range(layers))
    return _mlp_layer_types(cfg, path, layers)


def _mlp_layer_types(cfg: dict[str, Any], path: Path, layers: int) -> tuple[int, ...]:
    """1 per MoE layer of transformers' `mlp_layer_types` ('dense' / 'sparse' per layer)."""
    types = cfg.get("mlp_layer_types")
    if not (
        isinstance(types, list) and len(types) == layers and all(t in ("dense", "sparse") for t in types)
    ):
        raise ConfigError(
            f"{path}:mlp_layer_types", types, f"must list 'dense' or 'sparse' for each of the {layers} layers"
        )
    return tuple(1 if t == "sparse" else 0 for t in types)


def _moe_layer_freq(cfg: dict[str, Any], model_type: str, path: Path, layers: int) -> tuple[int, ...]:
    """Which layers are MoE: DeepSeek/GLM's first_k_dense_replace (GLM-4.7-Flash's mlp_layer_types),
    Qwen-MoE's decoder_sparse_step and mlp_only_layers (all as transformers reads them)."""
    if model_type == "glm4_moe_lite":
        return _glm4_moe_lite_layers(cfg, path, layers)
    if model_type in DSA_MODEL_TYPES and cfg.get("mlp_layer_types") is not None:
        return _mlp_layer_types(cfg, path, layers)
    if model_type in DEEPSEEK_ROUTER_MODEL_TYPES:
        # transformers' GLM-5 and DeepSeek-V3.2 configs default to three dense layers.
        dense = int(cfg.get("first_k_dense_replace", 3 if model_type in DSA_MODEL_TYPES else 0) or 0)
        return tuple(0 if i < dense else 1 for i in range(layers))
    if model_type in QWEN_MOE_MODEL_TYPES:
        step = int(cfg.get("decoder_sparse_step") or 1)
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        return tuple(1 if i not in only_mlp and (i + 1) % step == 0 else 0 for i in range(layers))
    return (1,) * layers


def _indexer_types(cfg: dict[str, Any], path: Path, layers: int) -> list[str]:
    """GLM-5's per-layer indexer kinds as transformers' GlmMoeDsaConfig reads them: `indexer_types`,
    else `index_topk_pattern` ('F'/'S' per layer), else the `index_topk_freq` schedule from
    `index_skip_topk_offset` (transformers' default 2)."""
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        kinds = {"F": "full", "S": "shared"}
        types = [kinds.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq = max(int(cfg.get("index_topk_freq", 1) or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if not (isinstance(types, list) and len(types) == layers and all(t in ("full", "shared") for t in types)):
        raise ConfigError(
            f"{path}:indexer_types", types, f"must list 'full' or 'shared' for each of the {layers} layers"
        )
    if types and types[0] == "shared":
        raise ConfigError(f"{path}:indexer_types", types, "layer 0 has no earlier indexer to share")
    return types


def _sparse_attention_fields(
    cfg: dict[str, Any], model_type: str, path: Path, layers: int, mla: dict[str, Any]
) -> dict[str, Any]:
    """DeepSeek sparse attention's indexer (tether.train.model.families.dsa): its heads, their size
    (RoPE on the first qk_rope_head_dim dims, so more than those), top-k and per-layer sharing."""
    heads = int(_field(cfg, "index_n_heads", path))
    head_dim = int(_field(cfg, "index_head_dim", path))
    topk = int(_field(cfg, "index_topk", path))
    rope = int(mla["qk_pos_emb_head_dim"])
    if head_dim <= rope:
        raise ConfigError(
            f"{path}:index_head_dim", head_dim, f"must exceed qk_rope_head_dim={rope} (RoPE's share of it)"
        )
    if topk < 1 or heads < 1:
        raise ConfigError(f"{path}:index_topk", topk, "index_topk and index_n_heads must be positive")
    if mla.get("q_lora_rank") is None:
        raise ConfigError(f"{path}:q_lora_rank", None, "the indexer reads the compressed query (q_lora_rank)")
    shared = (
        tuple(t == "shared" for t in _indexer_types(cfg, path, layers))
        if model_type == "glm_moe_dsa"
        else (False,) * layers
    )
    return {
        "index_heads": heads,
        "index_head_dim": head_dim,
        "index_topk": topk,
        # transformers: GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves.
        "index_rope_interleaved": model_type == "glm_moe_dsa",
        "index_shared": shared,
    }


def _moe_fields(cfg: dict[str, Any], model_type: str, path: Path, layers: int) -> dict[str, Any]:
    topk = int(_field(cfg, "num_experts_per_tok", path))
    out: dict[str, Any] = {
        "moe_router_topk": topk,
        "moe_layer_freq": _moe_layer_freq(cfg, model_type, path, layers),
    }
    if model_type == "minimax_m2":
        # Sigmoid scores, a correction bias for the choice, renormalized top-k weights, no groups.
        out.update(
            num_experts=int(_first(cfg, path, "num_local_experts", "num_experts")),
            moe_ffn_hidden_size=int(_field(cfg, "intermediate_size", path)),
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=True,
            moe_router_enable_expert_bias=True,
        )
        return out
    if model_type == "mixtral":
        # Mixtral renormalizes the top-k softmax probabilities: top-k on logits, then softmax.
        out.update(num_experts=int(_first(cfg, path, "num_local_experts", "num_experts")))
        out.update(moe_ffn_hidden_size=int(_field(cfg, "intermediate_size", path)))
        return out
    if model_type in QWEN_MOE_MODEL_TYPES:
        out["num_experts"] = int(_first(cfg, path, "num_experts", "num_local_experts"))
        out["moe_ffn_hidden_size"] = int(_field(cfg, "moe_intermediate_size", path))
        out["moe_router_pre_softmax"] = not cfg.get("norm_topk_prob", model_type != "qwen2_moe")
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe") and shared:
            out["moe_shared_expert_intermediate_size"] = shared
            out["moe_shared_expert_gate"] = True
        return out
    # DEEPSEEK_ROUTER_MODEL_TYPES: sigmoid scores, selection bias, group-limited routing, scaled weights.
    experts = int(_field(cfg, "n_routed_experts", path))
    out.update(
        num_experts=experts,
        moe_ffn_hidden_size=int(_field(cfg, "moe_intermediate_size", path)),
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=True,
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared * out["moe_ffn_hidden_size"]
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        # Megatron always renormalizes sigmoid top-k weights (moe_utils.topk_routing_with_score_function).
        raise ConfigError(
            f"{path}:norm_topk_prob", False, "Megatron renormalizes sigmoid top-k weights whenever top-k > 1"
        )
    groups = int(cfg.get("n_group") or 1)
    if groups > 1:
        group_topk = int(_field(cfg, "topk_group", path))
        if topk // group_topk != 2:
            # HF scores a group by its best 2 experts; Megatron by its best top-k / group-top-k.
            raise ConfigError(
                f"{path}:topk_group",
                group_topk,
                f"Megatron scores a group by its top num_experts_per_tok/topk_group = {topk}//{group_topk} "
                "experts and the Hugging Face model by its top 2; they differ",
            )
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return out


def _qwen3_next_fields(cfg: dict[str, Any], path: Path, layers: int) -> dict[str, Any]:
    """Qwen3-Next's token mixers per layer (layer_types, else a full-attention layer every
    full_attention_interval layers, as transformers' Qwen3NextConfig derives them) and linear
    attention's shape; its norms are zero-centred and its full attention gated."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not (
        isinstance(types, list)
        and len(types) == layers
        and all(t in ("linear_attention", "full_attention") for t in types)
    ):
        raise ConfigError(
            f"{path}:layer_types",
            types,
            f"must list 'linear_attention' or 'full_attention' for each of the {layers} layers",
        )
    key_heads = int(_field(cfg, "linear_num_key_heads", path))
    value_heads = int(_field(cfg, "linear_num_value_heads", path))
    if value_heads % key_heads:
        raise ConfigError(
            f"{path}:linear_num_value_heads",
            value_heads,
            f"must be a multiple of linear_num_key_heads={key_heads}",
        )
    return {
        "linear_attention": tuple(1 if t == "linear_attention" else 0 for t in types),
        "linear_conv_kernel_dim": int(_field(cfg, "linear_conv_kernel_dim", path)),
        "linear_key_head_dim": int(_field(cfg, "linear_key_head_dim", path)),
        "linear_value_head_dim": int(_field(cfg, "linear_value_head_dim", path)),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "attention_output_gate": True,
        "zero_centered_norms": True,
    }


def language_model_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The language model's config and where its tensors sit (`ModelArch.hf_prefix`). A Qwen3.5
    checkpoint as published is a vision-language model: its decoder's fields are under text_config
    (tie_word_embeddings at the top), its tensors under model.language_model.; its text-only form
    (model_type qwen3_5_text / qwen3_5_moe_text) is the same decoder under model.."""
    model_type = cfg.get("model_type")
    if model_type in TEXT_ONLY_MODEL_TYPES:
        return {**cfg, "model_type": TEXT_ONLY_MODEL_TYPES[model_type]}, "model."
    text = cfg.get("text_config")
    if model_type not in QWEN3_5_MODEL_TYPES or not isinstance(text, dict):
        return cfg, "model."
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": model_type, "tie_word_embeddings": tied}, "model.language_model."


def _check_mla_rope(cfg: dict[str, Any], path: Path, rotary_percent: float) -> None:
    """Megatron's MLA rotates all of qk_rope_head_dim in interleaved pairs (HF's rope_interleave)."""
    if cfg.get("rope_interleave", True) is not True:
        raise ConfigError(
            f"{path}:rope_interleave",
            cfg["rope_interleave"],
            "Megatron's multi-latent attention rotates interleaved pairs only (true)",
        )
    if rotary_percent != 1.0:
        raise ConfigError(
            f"{path}:partial_rotary_factor",
            rotary_percent,
            "multi-latent attention rotates all of qk_rope_head_dim (1.0)",
        )


def load_arch(hf_dir: str | Path) -> ModelArch:
    """Read `hf_dir/config.json`; reject families and features tether cannot build exactly."""
    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError("--hf-checkpoint", str(hf_dir), "has no config.json") from e
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), str(e), "not valid JSON") from e
    check_model_type(_field(cfg, "model_type", path), path)
    check_unquantized(cfg, path)
    cfg, hf_prefix = language_model_config(cfg)
    model_type = str(cfg["model_type"])
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}:hidden_act", cfg["hidden_act"], "only silu (SwiGLU) is supported")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{path}:mlp_bias", True, "MLP biases are not supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{path}:use_sliding_window", True, "sliding-window attention is not supported")
    hidden = int(_field(cfg, "hidden_size", path))
    heads = int(_field(cfg, "num_attention_heads", path))
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ConfigError(f"{path}:num_key_value_heads", groups, f"must divide num_attention_heads={heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # Qwen2(-MoE) always has q/k/v biases; the others have them when attention_bias is set, and then
    # (except GLM-4.5) o_proj has one too, which Megatron's add_qkv_bias cannot express.
    if model_type in ("qwen2", "qwen2_moe", "mimo"):
        qkv_bias = True
    elif model_type == "glm4":
        qkv_bias = bool(cfg.get("attention_bias", True))  # transformers' Glm4Config default
    elif model_type == "glm4_moe":
        qkv_bias = bool(cfg.get("attention_bias"))
    elif model_type in MLA_MODEL_TYPES and cfg.get("attention_bias"):
        # Megatron's MLA has no bias on its down projections (q_a_proj, kv_a_proj_with_mqa).
        raise ConfigError(
            f"{path}:attention_bias", True, "q_a_proj/kv_a_proj_with_mqa/o_proj biases are not supported"
        )
    elif cfg.get("attention_bias"):
        raise ConfigError(f"{path}:attention_bias", True, "o_proj bias is not supported")
    else:
        qkv_bias = False
    theta, factor = _rope(cfg, path)
    layers = int(_field(cfg, "num_hidden_layers", path))
    params = cfg.get("rope_parameters") or {}
    # transformers' Glm4Config rotates half the head dim when the config names no factor.
    default_rotary = 0.5 if model_type == "glm4" else 1.0
    if model_type == "minimax_m2" and cfg.get("rotary_dim"):
        # MiniMax-M2's own config.json names the rotated dims (transformers derives the factor)
        default_rotary = int(cfg["rotary_dim"]) / head_dim
    extra: dict[str, Any] = {
        "rotary_percent": float(
            params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_rotary))
        )
    }
    if model_type == "minimax_m2":
        check_minimax_m2_keys(cfg, path)
        extra["qk_norm_full"] = True
    if model_type == "glm4":
        # Glm4DecoderLayer's extra norms; Glm4's apply_rotary_pos_emb rotates interleaved pairs.
        extra.update(post_sublayer_norms=True, rotary_interleaved=True)
    if model_type in MOE_MODEL_TYPES:
        extra.update(_moe_fields(cfg, model_type, path, layers))
    if model_type in GATED_DELTANET_MODEL_TYPES:
        extra.update(_qwen3_next_fields(cfg, path, layers))
        extra["linear_attention_split"] = model_type in QWEN3_5_MODEL_TYPES
        # The MTP module (mtp.*) is not built; Qwen3.5's vision tower (model.visual.*) not trained.
        extra["hf_kept_prefixes"] = ("mtp.", "model.visual.") if hf_prefix != "model." else ("mtp.",)
    extra["hf_prefix"] = hf_prefix
    if model_type in MTP_MODEL_TYPES:
        extra["mtp_layers"] = int(cfg.get("num_nextn_predict_layers") or 0)
    if model_type in MLA_MODEL_TYPES:
        _check_mla_rope(cfg, path, extra["rotary_percent"])
        q_lora = cfg.get("q_lora_rank")
        extra.update(
            multi_latent_attention=True,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(_field(cfg, "kv_lora_rank", path)),
            qk_head_dim=int(_field(cfg, "qk_nope_head_dim", path)),
            qk_pos_emb_head_dim=int(_field(cfg, "qk_rope_head_dim", path)),
            v_head_dim=int(_field(cfg, "v_head_dim", path)),
            yarn=_yarn(cfg),
        )
        head_dim = extra["qk_head_dim"] + extra["qk_pos_emb_head_dim"]
    if model_type in DSA_MODEL_TYPES:
        extra.update(_sparse_attention_fields(cfg, model_type, path, layers, extra))
    # DeepSeek's MLA normalizes its compressed q and kv (Megatron's --qk-layernorm with MLA).
    qk_layernorm = model_type in (
        "qwen3",
        "qwen3_moe",
        "minimax_m2",
        *GATED_DELTANET_MODEL_TYPES,
        *MLA_MODEL_TYPES,
    ) or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm")))
    return ModelArch(
        model_type=model_type,
        vocab_size=int(_field(cfg, "vocab_size", path)),
        hidden_size=hidden,
        # Qwen3.5-MoE's text config has no dense FFN size (every layer is MoE).
        ffn_hidden_size=int(
            _field(
                cfg, "moe_intermediate_size" if "intermediate_size" not in cfg else "intermediate_size", path
            )
        ),
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        **extra,
    )


def check_parallel(
    arch: ModelArch,
    tp_size: int,
    pp_size: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    *,
    ep_size: int = 1,
    etp_size: int | None = None,
    sequence_parallel: bool | None = None,
    cp_size: int = 1,
    allgather_cp: bool = False,
) -> None:
    """Reject TP/PP/EP/CP sizes (and uneven stage sizes) the model cannot be split by, naming the flag.

    `sequence_parallel` (--sequence-parallel; None: not known here): Megatron trains MoE layers at
    TP > 1 only with sequence parallelism (`MoELayer.forward` refuses otherwise, as Megatron-LM's
    argument checks do), so a run without it is refused before it starts.
    """
    if arch.is_moe and tp_size > 1 and sequence_parallel is False:
        raise ConfigError(
            "--tensor-model-parallel-size",
            tp_size,
            f"an MoE model ({arch.model_type}) trains at TP > 1 only with --sequence-parallel "
            "(Megatron's rule); add it",
        )
    if arch.linear_attention is not None and tp_size > 1 and sequence_parallel is False:
        # Linear attention's output norm is shared by the value heads TP splits: Megatron sums its
        # gradient over TP only for sequence-parallel weights (finalize_model_grads).
        raise ConfigError(
            "--tensor-model-parallel-size",
            tp_size,
            f"{arch.model_type}'s linear attention trains at TP > 1 only with --sequence-parallel "
            "(its output norm's gradient is summed over TP as a sequence-parallel weight's); add it",
        )
    if arch.num_query_groups % tp_size or arch.num_attention_heads % tp_size:
        raise ConfigError(
            "--tensor-model-parallel-size",
            tp_size,
            f"must divide num_key_value_heads={arch.num_query_groups} and heads={arch.num_attention_heads}",
        )
    if arch.ffn_hidden_size % tp_size and (arch.moe_layer_freq is None or 0 in arch.moe_layer_freq):
        raise ConfigError(
            "--tensor-model-parallel-size", tp_size, f"must divide intermediate_size={arch.ffn_hidden_size}"
        )
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(arch, field)
        if heads is not None and heads % tp_size:
            raise ConfigError(
                "--tensor-model-parallel-size", tp_size, f"must divide linear attention's {field}={heads}"
            )
    if arch.moe_shared_expert_intermediate_size and arch.moe_shared_expert_intermediate_size % tp_size:
        raise ConfigError(
            "--tensor-model-parallel-size",
            tp_size,
            f"must divide the shared experts' size {arch.moe_shared_expert_intermediate_size}",
        )
    if arch.is_moe:
        assert arch.num_experts is not None and arch.moe_ffn_hidden_size is not None
        if arch.num_experts % ep_size:
            raise ConfigError(
                "--expert-model-parallel-size", ep_size, f"must divide the {arch.num_experts} experts"
            )
        # Experts may be split over fewer TP ranks than the dense layers (slime's MoE recipes run
        # ETP=1 under TP>1): tether.train.model.build reduces their gradients over the expert
        # data-parallel group that holds the other TP ranks.
        etp = etp_size if etp_size is not None else tp_size
        if arch.moe_ffn_hidden_size % etp:
            flag = "--expert-tensor-parallel-size" if etp_size is not None else "--tensor-model-parallel-size"
            raise ConfigError(
                flag, etp, f"must divide the experts' moe_intermediate_size={arch.moe_ffn_hidden_size}"
            )
    elif ep_size != 1 or etp_size not in (None, 1):
        flag, value = (
            ("--expert-model-parallel-size", ep_size)
            if ep_size != 1
            else ("--expert-tensor-parallel-size", etp_size)
        )
        raise ConfigError(flag, value, f"the Hugging Face model ({arch.model_type}) has no experts")
    sizes = stage_layers(
        arch.num_layers,
        pp_size,
        first_stage_layers,
        last_stage_layers,
        layers_flag="num_hidden_layers of the Hugging Face config",
    )
    if arch.index_shared is not None:
        # A stage must start with a computing layer: a shared one reuses the previous layer's choice.
        start = 0
        for size in sizes[:-1]:
            start += size
            if arch.index_shared[start]:
                raise ConfigError(
                    "--pipeline-model-parallel-size",
                    pp_size,
                    f"a stage would start at layer {start} (0-based), which reuses an earlier layer's "
                    "sparse-attention choice (indexer_types 'shared'); split where every stage starts "
                    "with a 'full' layer (--decoder-first/last-pipeline-num-layers)",
                )
    if allgather_cp and cp_size > 1 and arch.index_heads is None:
        raise ConfigError(
            "--allgather-cp",
            True,
            "the contiguous all-gather CP layout is for DeepSeek sparse-attention models only (GLM-5 "
            f"glm_moe_dsa, DeepSeek-V3.2 deepseek_v32; slime's rule); {arch.model_type}'s attention takes "
            "Megatron's load-balanced chunks: remove --allgather-cp",
        )


def parse_moe_layer_freq(value: str, num_layers: int, flag: str = "--moe-layer-freq") -> tuple[int, ...]:
    """Megatron's --moe-layer-freq: an integer N (an MoE layer every N layers, from the first) or a
    Python list expression of 0/1 per layer such as "[0]*1+[1]*2"; read without eval."""
    import ast

    def evaluate(node: ast.AST) -> int | list[int]:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.List):
            items = [evaluate(e) for e in node.elts]
            if not all(isinstance(i, int) for i in items):
                raise ValueError("nested lists")
            return [int(i) for i in items]  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add):
            left, right = evaluate(node.left), evaluate(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
                return left * right
            if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, list):
                return right * left
        raise ValueError(ast.dump(node))

    try:
        got = evaluate(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(flag, value, "must be an integer or a list expression such as [0]*1+[1]*3") from e
    if isinstance(got, int):
        if got < 1:
            raise ConfigError(flag, value, "must be >= 1")
        return tuple(1 if i % got == 0 else 0 for i in range(num_layers))
    if len(got) != num_layers or any(v not in (0, 1) for v in got):
        raise ConfigError(flag, value, f"must list 0 or 1 for each of the {num_layers} layers")
    return tuple(got)


def transformer_shape(arch: ModelArch) -> dict[str, int]:
    """The decoder's shape under the names Megatron's TransformerConfig and its flags share."""
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
    }


def check_architecture_flags(arch: ModelArch, flags: dict[str, object]) -> None:
    """Reject Megatron architecture flags (from a slime script) that disagree with the HF config."""
    yarn = dict(arch.yarn or ())
    expected: dict[str, object] = {
        **transformer_shape(arch),
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rotary_base": arch.rope_theta,
        "norm_epsilon": arch.norm_epsilon,
        "normalization": "RMSNorm",
        "swiglu": True,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_layernorm,
        "untie_embeddings_and_output_weights": not arch.tie_word_embeddings,
        "position_embedding_type": "rope",
        "use_rotary_position_embeddings": True,
        "disable_bias_linear": True,
        "group_query_attention": arch.num_query_groups != arch.num_attention_heads,
        "rotary_percent": arch.rotary_percent,
        "rotary_interleaved": arch.rotary_interleaved,
        "post_self_attn_layernorm": arch.post_sublayer_norms,
        "post_mlp_layernorm": arch.post_sublayer_norms,
        # Qwen3-Next: gated full attention (two spellings in slime's scripts), zero-centred norms.
        "attention_output_gate": arch.attention_output_gate,
        "use_gated_attention": arch.attention_output_gate,
        "apply_layernorm_1p": arch.zero_centered_norms,
        # Mixture of experts and multi-latent attention: properties of the checkpoint too.
        "num_experts": arch.num_experts,
        "moe_router_topk": arch.moe_router_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
        "moe_router_score_function": arch.moe_router_score_function if arch.is_moe else None,
        "moe_router_num_groups": arch.moe_router_num_groups,
        "moe_router_group_topk": arch.moe_router_group_topk,
        "moe_router_topk_scaling_factor": arch.moe_router_topk_scaling_factor,
        "moe_router_enable_expert_bias": arch.moe_router_enable_expert_bias,
        "moe_router_pre_softmax": arch.moe_router_pre_softmax if arch.is_moe else False,
        "multi_latent_attention": arch.multi_latent_attention,
        "q_lora_rank": arch.q_lora_rank,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_head_dim": arch.qk_head_dim,
        "qk_pos_emb_head_dim": arch.qk_pos_emb_head_dim,
        "v_head_dim": arch.v_head_dim,
        "rotary_scaling_factor": yarn.get("rotary_scaling_factor", arch.rope_scaling_factor or 1.0),
        "mscale": yarn.get("mscale", 1.0),
        "mscale_all_dim": yarn.get("mscale_all_dim", 1.0),
    }
    if arch.multi_latent_attention:
        # MLA's head dims are --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim (checked above);
        # Megatron does not size MLA by --kv-channels, which slime's scripts set to the value dim.
        del expected["kv_channels"]
        # MLA has no q/k/v projections: its linears take a bias from add_bias_linear and never read
        # --add-qkv-bias (which slime's GLM-4.7-Flash script passes).
        del expected["add_qkv_bias"]
    if arch.is_moe and arch.moe_router_num_groups is None:
        # One expert group (n_group=1) is the same routing as none.
        expected["moe_router_num_groups"] = 1 if flags.get("moe_router_num_groups") == 1 else None
        expected["moe_router_group_topk"] = 1 if flags.get("moe_router_group_topk") == 1 else None
    check_mtp_layers(arch, flags.get("mtp_num_layers"))
    check_model_name(arch, flags.get("model_name"))
    spec = flags.get("spec")
    family = _FAMILY_SPECS.get(spec[0]) if isinstance(spec, list) and spec else None
    if isinstance(spec, list) and family is not None and arch.model_type not in family[0]:
        raise ConfigError(
            "--spec",
            " ".join(spec),
            f"builds {family[1]}'s layers; the Hugging Face config is {arch.model_type}",
        )
    seq_length = flags.get("seq_length")
    if isinstance(seq_length, int) and seq_length > arch.max_position_embeddings:
        raise ConfigError(
            "--seq-length",
            seq_length,
            f"exceeds max_position_embeddings={arch.max_position_embeddings} of the Hugging Face config",
        )
    freq = flags.get("moe_layer_freq")
    if isinstance(freq, str):
        pattern = parse_moe_layer_freq(freq, arch.num_layers)
        if pattern != arch.moe_layer_freq:
            raise ConfigError(
                "--moe-layer-freq",
                freq,
                f"gives MoE layers {list(pattern)}; the Hugging Face config ({arch.model_type}) has "
                f"{list(arch.moe_layer_freq) if arch.moe_layer_freq else 'no experts'}",
            )
    for name, value in flags.items():
        if name not in expected:
            continue  # sequence length, vocab padding, kernels: not properties of the checkpoint
        want = expected[name]
        if isinstance(want, float) and isinstance(value, int | float):
            same = abs(float(value) - want) <= 1e-12 * max(1.0, abs(want))
        else:
            same = value == want
        if not same:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(flag, value, f"the Hugging Face config ({arch.model_type}) has {want!r}")


def _squashed(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


# The names slime converts with DeepSeek-V3's converter (megatron_to_hf/__init__.py), before it
# tries GLM-4.5's ("glm4moe" is also in "glm4moelite").
_DEEPSEEK_CONVERTER = ("glm4moelite", "deepseekv3", "deepseekv32", "glmmoedsa", "kimi")
# slime converts Qwen3.5-MoE by "qwen35" too (its converter serves both).
_CONVERTER_ALIASES: dict[str, tuple[str, ...]] = {"mimo": ("qwen2",), "qwen35moe": ("qwen35",)}


def check_model_name(arch: ModelArch, model_name: object) -> None:
    """--model-name (slime picks its Megatron-to-HF converter by it) must name the family of the
    Hugging Face config, which is what tether converts by: as slime matches it, by substring."""
    if not isinstance(model_name, str):
        return
    name, family = _squashed(model_name), _squashed(arch.model_type)
    deepseek = any(alias in name for alias in _DEEPSEEK_CONVERTER)
    if arch.model_type in MLA_MODEL_TYPES:
        named = deepseek
    else:  # a name slime sends to DeepSeek-V3's converter names no other family
        named = not deepseek and (
            family in name or any(alias in name for alias in _CONVERTER_ALIASES.get(family, ()))
        )
    if named:
        return
    raise ConfigError(
        "--model-name",
        model_name,
        f"names another family than the Hugging Face config ({arch.model_type}), by which tether converts",
    )


def check_mtp_layers(arch: ModelArch, mtp_num_layers: object) -> None:
    """--mtp-num-layers builds that many of the checkpoint's MTP layers, loaded from its weights: the
    family must have MTP layers and the checkpoint at least that many (0/unset: none built)."""
    if not mtp_num_layers:
        return
    if arch.model_type not in MTP_MODEL_TYPES:
        raise ConfigError(
            "--mtp-num-layers",
            mtp_num_layers,
            f"the Hugging Face config ({arch.model_type}) has no multi-token-prediction layers; "
            f"families with them: {', '.join(MTP_MODEL_TYPES)}",
        )
    if arch.index_heads is not None:
        raise ConfigError(
            "--mtp-num-layers",
            mtp_num_layers,
            f"the MTP layers of a sparse-attention model ({arch.model_type}) are not built: their "
            "indexer's selection is not trained or checked here; the engines run them as drafters "
            "from the checkpoint as they are",
        )
    if not isinstance(mtp_num_layers, int) or mtp_num_layers > arch.mtp_layers:
        raise ConfigError(
            "--mtp-num-layers",
            mtp_num_layers,
            f"the Hugging Face config ({arch.model_type}) has num_nextn_predict_layers={arch.mtp_layers}",
        )

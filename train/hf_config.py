"""Hugging Face config.json → the architecture tether builds in Megatron (Llama, Qwen2, Qwen3 dense).

`ModelArch` is read from config.json directly (no transformers import) and maps onto
Megatron's `TransformerConfig` plus the GPTModel arguments. Both rope layouts are accepted:
transformers 5 (`rope_parameters`) and earlier (`rope_theta` + `rope_scaling`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.runtime.errors import ConfigError
from tether.train.config import stage_layers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# Megatron's llama3 RoPE scaling hard-codes these; other values cannot be represented.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelArch:
    """A dense decoder's shape, in HF terms, enough to build it in Megatron and convert weights."""

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


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, float | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        source = params if params.get("rope_type") == "llama3" else scaling
        for key, want in _LLAMA3_FIXED.items():
            if key in source and float(source[key]) != want:
                raise ConfigError(
                    f"{path}:rope {key}", source[key], f"Megatron's llama3 RoPE supports only {want}"
                )
        return float(theta), float(source.get("factor", 8.0))
    raise ConfigError(f"{path}:rope_type", rope_type, "supported: default, llama3")


def load_arch(hf_dir: str | Path) -> ModelArch:
    """Read `hf_dir/config.json`; reject families and features tether cannot build exactly."""
    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError("--hf-checkpoint", str(hf_dir), "has no config.json") from e
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), str(e), "not valid JSON") from e
    model_type = _field(cfg, "model_type", path)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{path}:model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
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
    # Qwen2 always has q/k/v biases; Llama/Qwen3 have them when attention_bias is set, and then
    # o_proj has one too, which Megatron's add_qkv_bias cannot express.
    if model_type == "qwen2":
        qkv_bias = True
    elif cfg.get("attention_bias"):
        raise ConfigError(f"{path}:attention_bias", True, "o_proj bias is not supported")
    else:
        qkv_bias = False
    theta, factor = _rope(cfg, path)
    return ModelArch(
        model_type=model_type,
        vocab_size=int(_field(cfg, "vocab_size", path)),
        hidden_size=hidden,
        ffn_hidden_size=int(_field(cfg, "intermediate_size", path)),
        num_layers=int(_field(cfg, "num_hidden_layers", path)),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=model_type == "qwen3",
    )


def check_parallel(
    arch: ModelArch,
    tp_size: int,
    pp_size: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> None:
    """Reject TP/PP sizes (and uneven stage sizes) the model cannot be split by, naming the flag."""
    if arch.num_query_groups % tp_size or arch.num_attention_heads % tp_size:
        raise ConfigError(
            "--tensor-model-parallel-size",
            tp_size,
            f"must divide num_key_value_heads={arch.num_query_groups} and heads={arch.num_attention_heads}",
        )
    if arch.ffn_hidden_size % tp_size:
        raise ConfigError(
            "--tensor-model-parallel-size", tp_size, f"must divide intermediate_size={arch.ffn_hidden_size}"
        )
    stage_layers(
        arch.num_layers,
        pp_size,
        first_stage_layers,
        last_stage_layers,
        layers_flag="num_hidden_layers of the Hugging Face config",
    )


def transformer_config(
    arch: ModelArch,
    *,
    tp_size: int,
    pp_size: int,
    params_dtype: torch.dtype = torch.float32,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    sequence_parallel: bool = False,
    init_weights: bool = False,
    **overrides: Any,
) -> Any:
    """Megatron TransformerConfig for `arch` at TP/PP; `overrides` set any other field.

    Fusions are off unless an override turns them on (they need CUDA kernels); the trainer's
    flags reach this through `tether.train.megatron_args.transformer_config_kwargs`.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallel(
        arch,
        tp_size,
        pp_size,
        overrides.get("num_layers_in_first_pipeline_stage"),
        overrides.get("num_layers_in_last_pipeline_stage"),
    )
    cuda = torch.cuda.is_available()
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not cuda,
        # Off: HF weights overwrite every parameter. Megatron then leaves its TP layers' weights
        # without TP attributes; tether.train.model.mark_tensor_parallel_params sets them.
        perform_initialization=init_weights,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Megatron's default "full" means [] and warns on every config it builds.
        cuda_graph_scope=[],
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def check_architecture_flags(arch: ModelArch, flags: dict[str, object]) -> None:
    """Reject Megatron architecture flags (from a slime script) that disagree with the HF config."""
    expected: dict[str, object] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rotary_base": arch.rope_theta,
        "rotary_percent": 1.0,
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
    }
    seq_length = flags.get("seq_length")
    if isinstance(seq_length, int) and seq_length > arch.max_position_embeddings:
        raise ConfigError(
            "--seq-length",
            seq_length,
            f"exceeds max_position_embeddings={arch.max_position_embeddings} of the Hugging Face config",
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

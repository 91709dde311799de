"""The CPU engine's model: a compact pure-torch forward for Llama, Qwen2 (and MiMo), Qwen3, GLM-4 and
the Mixture-of-Experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3 with multi-latent
attention and its kin GLM-4.7-Flash and Kimi-K2, GLM-4-MoE; GLM-5 and DeepSeek-V3.2, DeepSeek-V3's
layers with sparse attention's indexer, dsa.py), Qwen3-Next (gated-delta-net linear
attention, gdn.py, between layers of gated full attention) and Qwen3.5 (the same layers; published
as a vision-language checkpoint whose decoder is served under model.* and whose vision tower is
not served), with a slot-based KV cache, so one decode step runs every running sequence in one forward.

Supported: RMSNorm, RoPE (default rope type, theta from `rope_parameters` or `rope_theta`;
partial rotary and the pairwise-interleaved layout; YaRN scaling, rope.py), GQA, SwiGLU, qkv bias, per-head q/k
RMSNorm, GLM-4's sandwich norms and fused gate_up_proj, tied embeddings; MoE blocks are in
moe.py, multi-latent attention in mla.py. What is not supported (other rope scalings, sliding
windows, other activations) is refused at load by name; multi-token-prediction layers a
checkpoint carries are accepted and left out (plain decoding does not use them). Weights keep their Hugging Face
names, so every update path speaks the names a trainer exports; routed experts stored fused
(experts.gate_up_proj / experts.down_proj) are taken apart into each expert's names on every path.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from tether.rollout.cpu_engine.modeling import dsa, gdn
from tether.rollout.cpu_engine.modeling.dsa import DSAConfig
from tether.rollout.cpu_engine.modeling.families import DSA_MODEL_TYPES, MLA_MODEL_TYPES
from tether.rollout.cpu_engine.modeling.gdn import GDNConfig, GDNConfigError
from tether.rollout.cpu_engine.modeling.mla import MLAConfig, mla_attend, mla_project
from tether.rollout.cpu_engine.modeling.moe import MoEConfig, MoEConfigError, moe_block
from tether.rollout.cpu_engine.modeling.rope import YarnConfig, rope_tables
from tether.runtime.errors import UserError

SUPPORTED_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "glm4",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "mimo",
    "minimax_m2",
    "glm4_moe_lite",
    "kimi_k2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    *DSA_MODEL_TYPES,
)
# Gated-delta-net families: linear attention between gated full-attention layers, norms that scale
# by (1 + weight), a quarter of each head rotated by default, an MTP module (mtp.*) not served.
_GDN_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Qwen3.5 as published: a vision-language checkpoint, the decoder's config under text_config and its
# tensors under model.language_model. (served as model.*; the vision tower is not served), linear
# attention's projections apart. Its text-only form has these model_types.
_QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
_TEXT_ONLY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
LANGUAGE_MODEL_PREFIX = "model.language_model."
# Families whose checkpoints may carry multi-token-prediction (MTP) layers. Plain decoding does
# not use them (transformers drops them too), so their tensors are accepted and left out.
_MTP_FAMILIES = ("glm4_moe", "mimo", *MLA_MODEL_TYPES)
# Families whose q/k/v projections carry a bias unless the config says otherwise.
_QKV_BIAS_DEFAULT = {"qwen2": True, "qwen2_moe": True, "glm4": True}


class ModelConfigError(UserError, ValueError):
    """The model directory cannot be served (names the file or the config key)."""


class WeightMismatch(ValueError):
    """A set of named tensors does not fit the model (names the tensor and what is wrong)."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    qk_norm_full: bool = False  # the q and k norms span all heads (MiniMax-M2), not one head
    eos_token_ids: tuple[int, ...]
    rotary_dim: int = 0  # how many leading dims of each head RoPE rotates (0: the head dim)
    rope_pairs: bool = False  # rotate adjacent pairs (GLM-4, DeepSeek's rope_interleave)
    sandwich_norm: bool = False  # GLM-4: post_self_attn_layernorm and post_mlp_layernorm
    fused_gate_up: bool = False  # GLM-4's dense MLP holds gate and up in one gate_up_proj
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None  # sparse attention's indexer on top of MLA (GLM-5, DeepSeek-V3.2)
    yarn: YarnConfig | None = None  # YaRN rope scaling; None: plain RoPE
    mtp_layers: int = 0  # the checkpoint's MTP layers (num_nextn_predict_layers), not served
    # Qwen3-Next: gated-delta-net linear attention on the layers gdn.linear_layers marks, norms
    # that scale by (1 + weight), and full attention whose q_proj also yields a sigmoid output gate.
    gdn: GDNConfig | None = None
    zero_centered_norm: bool = False
    attn_output_gate: bool = False
    # The checkpoint nests the decoder under model.language_model. beside a vision tower (Qwen3.5).
    vision_language: bool = False

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"{cfg_path}: cannot read config: {e}") from e
        raw = _language_model(raw)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ModelConfigError(f"{cfg_path}: model_type={model_type!r} is not one of {SUPPORTED_TYPES}")
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            rope = {}
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ModelConfigError(f"{cfg_path}: rope_scaling={scaling!r} is not a mapping")
        # transformers 5 writes `rope_parameters`; older configs (DeepSeek-V3's own) `rope_scaling`.
        scaled = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else scaling
        rope_type = scaled.get("rope_type", scaled.get("type", "default")) if scaled else "default"
        if rope_type not in ("default", "yarn"):
            raise ModelConfigError(f"{cfg_path}: rope scaling {rope_type!r} is not supported (only yarn)")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = float(theta if theta is not None else raw.get("rope_theta", 10000.0))
        max_position = int(raw.get("max_position_embeddings", 2048))
        try:
            yarn = YarnConfig.from_params(scaled, max_position) if rope_type == "yarn" else None
        except (ValueError, TypeError) as e:
            raise ModelConfigError(f"{cfg_path}: yarn rope scaling {scaled!r}: {e}") from e
        _refuse_unsupported(cfg_path, model_type, raw)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        try:
            moe = MoEConfig.from_raw(model_type, raw, layers)
            mla = MLAConfig.from_raw(raw) if model_type in MLA_MODEL_TYPES else None
            sparse_attn = (
                DSAConfig.from_raw(model_type, raw, layers) if model_type in DSA_MODEL_TYPES else None
            )
            linear = (
                GDNConfig.from_raw(raw, layers, split_proj=model_type in _QWEN3_5)
                if model_type in _GDN_FAMILIES
                else None
            )
        except (MoEConfigError, GDNConfigError, ValueError) as e:
            raise ModelConfigError(f"{cfg_path}: {e}") from e
        head_dim = int(raw.get("head_dim") or hidden // heads) if mla is None else mla.qk_dim
        partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
        # transformers' Qwen3-Next rotates a quarter of each head unless the config says otherwise.
        default_partial = 0.25 if model_type in _GDN_FAMILIES else 1.0
        partial = float(partial if partial is not None else raw.get("partial_rotary_factor", default_partial))
        rotary_dim = mla.qk_rope_dim if mla is not None else int(head_dim * partial)
        if mla is not None and partial != 1.0:  # transformers' MLA rotates all of qk_rope_head_dim
            raise ModelConfigError(f"{cfg_path}: partial_rotary_factor={partial} is not supported (only 1.0)")
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ModelConfigError(
                f"{cfg_path}: partial_rotary_factor={partial} gives rotary dim {rotary_dim}"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        gen_path = Path(path) / "generation_config.json"
        if gen_path.exists():
            try:
                gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:
                raise ModelConfigError(f"{gen_path}: cannot read the generation config: {e}") from e
            if isinstance(gen_eos, list):
                eos_ids = tuple(dict.fromkeys([*eos_ids, *gen_eos]))
            elif gen_eos is not None and gen_eos not in eos_ids:
                eos_ids = (*eos_ids, int(gen_eos))
        if model_type in ("qwen2", "mimo"):  # MiMo is Qwen2 plus MTP layers
            qkv_bias = True
        elif model_type == "qwen2_moe":
            qkv_bias = bool(raw.get("qkv_bias", True))
        else:
            qkv_bias = bool(raw.get("attention_bias", _QKV_BIAS_DEFAULT.get(model_type, False)))
        return cls(
            model_type=model_type,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=heads if mla is not None else int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            # Qwen3.5-MoE's text config has no dense FFN size (every layer is MoE).
            intermediate=int(raw.get("intermediate_size") or raw.get("moe_intermediate_size") or 0),
            vocab=int(raw["vocab_size"]),
            eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=max_position,
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias and mla is None,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "minimax_m2", *_GDN_FAMILIES)
            or bool(raw.get("use_qk_norm", False)),
            qk_norm_full=model_type == "minimax_m2",
            eos_token_ids=eos_ids,
            rotary_dim=rotary_dim,
            rope_pairs=model_type == "glm4" or (mla is not None and bool(raw.get("rope_interleave", True))),
            sandwich_norm=model_type == "glm4",
            fused_gate_up=model_type == "glm4",
            moe=moe,
            mla=mla,
            dsa=sparse_attn,
            yarn=yarn,
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0) if model_type in _MTP_FAMILIES else 0,
            gdn=linear,
            zero_centered_norm=model_type in _GDN_FAMILIES,
            attn_output_gate=model_type in _GDN_FAMILIES,
            vision_language=bool(raw.get("_vision_language")),
        )

    def unused(self, name: str) -> bool:
        """A checkpoint tensor the forward does not use: a tied checkpoint's lm_head, or an MTP
        layer's (DeepSeek-V3/GLM-4.5 number them after the decoder layers, MiMo keeps them in
        `model.mtp_layers`)."""
        if name == "lm_head.weight" and self.tie_embeddings:
            return True
        if self.model_type in _GDN_FAMILIES and name.startswith("mtp."):
            return True  # Qwen3-Next's and Qwen3.5's MTP module (transformers leaves `mtp.*` out too)
        if self.vision_language and name.startswith("model.visual."):
            return True  # the vision tower: text rollouts do not run it
        if not self.mtp_layers:
            return False
        if self.model_type == "mimo":
            return name.startswith("model.mtp_layers.")
        parts = name.split(".", 3)
        return (
            len(parts) > 3
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and self.layers <= int(parts[2]) < self.layers + self.mtp_layers
        )

    def canonical(self, name: str) -> str:
        """The name the engine keeps a checkpoint tensor under: a vision-language checkpoint's
        decoder tensors (model.language_model.*) as model.*, as SGLang's Qwen3.5 loader maps them."""
        if self.vision_language and name.startswith(LANGUAGE_MODEL_PREFIX):
            return "model." + name.removeprefix(LANGUAGE_MODEL_PREFIX)
        return name

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """(heads, width) of each per-layer KV cache store: keys and values, or MLA's latent (and
        the sparse-attention indexer's keys)."""
        if self.dsa is not None and self.mla is not None:
            return ((1, self.mla.cache_width), (1, self.dsa.dim))
        if self.mla is not None:
            return ((1, self.mla.cache_width),)
        return ((self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim))

    def cache_heads(self, layer: int, store: int) -> int:
        """The heads layer `layer` keeps per token in cache store `store`: none for a linear
        attention layer (its state is per slot) or in a shared-indexer layer's indexer store."""
        if self.linear(layer):
            return 0
        if self.dsa is not None and store == 1 and not self.dsa.full_layers[layer]:
            return 0
        return self.cache_shapes()[store][0]

    def linear(self, layer: int) -> bool:
        """Whether layer `layer` mixes tokens with linear attention (Qwen3-Next's gated delta net)."""
        return self.gdn is not None and self.gdn.linear_layers[layer]

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` holds an MoE block (else the dense MLP)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the model needs, by Hugging Face name."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab, self.hidden),
            "model.norm.weight": (self.hidden,),
        }
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (self.hidden,),
                p + "post_attention_layernorm.weight": (self.hidden,),
            }
            if self.sandwich_norm:
                shapes |= {
                    p + "post_self_attn_layernorm.weight": (self.hidden,),
                    p + "post_mlp_layernorm.weight": (self.hidden,),
                }
            if self.moe is not None and self.sparse(i):
                shapes |= self.moe.expected_shapes(i, self.hidden)
            elif self.fused_gate_up:
                shapes |= {
                    p + "mlp.gate_up_proj.weight": (2 * self.intermediate, self.hidden),
                    p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                }
            else:
                shapes |= {
                    p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                    p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                    p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                }
            if self.mla is not None:
                shapes |= self.mla.expected_shapes(i, self.hidden, self.heads)
                if self.dsa is not None:
                    shapes |= self.dsa.expected_shapes(i, self.hidden, self.mla.q_lora_rank)
                continue
            if self.gdn is not None and self.linear(i):
                shapes |= self.gdn.expected_shapes(i, self.hidden)
                continue
            shapes |= {
                p + "self_attn.q_proj.weight": (2 * q if self.attn_output_gate else q, self.hidden),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, q),
            }
            if self.qkv_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            if self.qk_norm:
                shapes |= {
                    p + "self_attn.q_norm.weight": (q if self.qk_norm_full else self.head_dim,),
                    p + "self_attn.k_norm.weight": (kv if self.qk_norm_full else self.head_dim,),
                }
        return shapes


_MINIMAX_M2_FIXED = {
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
}
"""What MiniMax-M2's config.json says where transformers' model always does it (routing, QK norms)."""


def _language_model(raw: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a Qwen3.5 vision-language config's text_config (tie_word_embeddings at
    the top; `_vision_language` marks where its tensors sit), a text-only form under its family."""
    model_type = raw.get("model_type")
    if model_type in _TEXT_ONLY:
        return {**raw, "model_type": _TEXT_ONLY[model_type]}
    text = raw.get("text_config")
    if model_type not in _QWEN3_5 or not isinstance(text, dict):
        return raw
    tied = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": model_type, "tie_word_embeddings": tied, "_vision_language": True}


def _refuse_unsupported(cfg_path: Path, model_type: str, raw: dict[str, Any]) -> None:
    """ModelConfigError naming a config key whose behaviour this forward does not implement."""
    if model_type == "minimax_m2":
        for key, want in _MINIMAX_M2_FIXED.items():
            if key in raw and raw[key] != want:
                raise ModelConfigError(
                    f"{cfg_path}: {key}={raw[key]!r} is not supported (MiniMax-M2 has {want!r})"
                )
        if any(t != 1 for t in raw.get("attn_type_list") or []):
            raise ModelConfigError(f"{cfg_path}: attn_type_list with linear attention (0) is not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{cfg_path}: hidden_act={act!r} is not supported (only 'silu')")
    if model_type in _GDN_FAMILIES:
        # Its layer_types name linear and full attention layers (GDNConfig checks them); its
        # o_proj would carry a bias too, which the forward does not apply.
        if raw.get("attention_bias"):
            raise ModelConfigError(f"{cfg_path}: attention_bias=true is not supported for {model_type}")
        return
    layer_types: list[str] = raw.get("layer_types") or []
    # transformers' sparse-attention configs name every layer "indexed_attention".
    full = "indexed_attention" if model_type in DSA_MODEL_TYPES else "full_attention"
    if raw.get("use_sliding_window") or any(t != full for t in layer_types):
        raise ModelConfigError(
            f"{cfg_path}: sliding window attention (use_sliding_window/layer_types) is not supported"
        )
    if model_type == "mixtral" and raw.get("sliding_window") is not None:
        raise ModelConfigError(f"{cfg_path}: sliding_window={raw['sliding_window']!r} is not supported")
    if model_type in MLA_MODEL_TYPES and raw.get("attention_bias"):
        raise ModelConfigError(f"{cfg_path}: attention_bias=true is not supported for {model_type}")
    if model_type == "llama" and raw.get("mlp_bias"):
        raise ModelConfigError(f"{cfg_path}: mlp_bias=true is not supported")


def check_named(cfg: ModelConfig, named: dict[str, torch.Tensor], complete: bool) -> None:
    """Raise WeightMismatch unless every tensor has a known name, float32 dtype and its shape.

    `complete` also requires every parameter to be present (a full checkpoint load). Tied
    checkpoints may carry an `lm_head.weight` equal to the embeddings, checkpoints with MTP layers
    their tensors (`ModelConfig.unused`); they are accepted and ignored.
    """
    expected = cfg.expected_shapes()
    named = {cfg.canonical(name): tensor for name, tensor in unfuse_experts(named).items()}
    for name, tensor in named.items():
        if cfg.unused(name):
            continue
        if name not in expected:
            raise WeightMismatch(f"unknown parameter name {name!r}")
        if tuple(tensor.shape) != expected[name]:
            raise WeightMismatch(f"{name}: shape {tuple(tensor.shape)} != expected {expected[name]}")
        if not tensor.dtype.is_floating_point:
            raise WeightMismatch(f"{name}: dtype {tensor.dtype} is not a floating point type")
    if complete:
        missing = sorted(set(expected) - set(named))
        if missing:
            raise WeightMismatch(f"missing parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def is_fused_experts(name: str) -> bool:
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def unfuse_experts(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Routed experts held fused, as transformers stores them for some families
    (`...experts.gate_up_proj` [E, 2I, H]: each expert's gate rows then its up rows;
    `...experts.down_proj` [E, H, I]), under each expert's own names; other tensors as they are."""
    if not any(is_fused_experts(name) for name in named):
        return named
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        prefix, _, last = name.rpartition(".")
        if not prefix.endswith(".experts") or last not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            if last == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path` (sharded checkpoints included)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{path}: no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            # A corrupt or truncated shard is the caller's bad input (400), named by its file.
            raise ModelConfigError(f"{file}: not a readable safetensors file: {e}") from e
    return out


_CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype config.json declares (`dtype`, or `torch_dtype` before transformers 5);
    float32 when it declares none, as SGLang assumes."""
    cfg_path = Path(path) / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{cfg_path}: cannot read config: {e}") from e
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if not isinstance(name, str) or name.removeprefix("torch.") not in _CONFIG_DTYPES:
        raise ModelConfigError(f"{cfg_path}: dtype={name!r} is not one of {sorted(_CONFIG_DTYPES)}")
    return _CONFIG_DTYPES[name.removeprefix("torch.")]


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None when all are finite."""
    with torch.inference_mode():
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                continue
            # One pass without an allocation: NaN and inf survive a sum, so a finite sum proves
            # every element finite; a non-finite one may only be an overflow, checked exactly.
            if torch.isfinite(tensor.sum()).item():
                continue
            if not bool(torch.isfinite(tensor).all()):
                return name
    return None


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """WeightMismatch naming the first tensor with NaN or inf (a diverged trainer's update)."""
    bad = first_nonfinite(named)
    if bad is not None:
        raise WeightMismatch(
            f"{bad}: holds NaN or inf values; the update is refused and nothing of it was applied "
            "(start the engine with --allow-nonfinite-weights to accept such weights)"
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 whatever the model's dtype, as transformers does (a no-op for a float32 model).
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def _additive(valid: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An attention mask to add to the scores: 0 where a key may be seen, -inf elsewhere (in the
    scores' dtype, on their device: SDPA takes no other)."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): RoPE over adjacent pairs."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


Routes = dict[int, torch.Tensor]
"""MoE layer index -> the expert ids its router chose, [B, T, top_k] (one forward's capture)."""


class KVCache:
    """What attention keeps per token, per layer, in slots: [slots, heads, capacity, width]
    for each store of `ModelConfig.cache_shapes` (keys and values; MLA's latent alone).

    Slots and capacity grow by doubling, so the cache costs what the running batch needs. It
    lives on the model's device, in the model's dtype.

    Linear-attention layers (Qwen3-Next's gated delta net) keep no entry per token: their
    stores hold no heads, and `states[i]` holds, per slot, the layer's conv window
    [slots, conv_dim, kernel - 1] (model dtype) and recurrent state [slots, v_heads, k_dim, v_dim]
    (float32). They live and die with the slot: a prefill overwrites a slot's states from empty
    states (a slot is never reused without one), a decode step advances them, release frees them
    with the slot's keys and values. Nothing is shared between slots beyond what one prefill
    copies to every slot of the same prompt, so there is no prefix cache that state would have to
    follow (a recurrent state is only valid at the exact end of the sequence it summarises).
    """

    def __init__(
        self, cfg: ModelConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.slots = 0
        self.capacity = 0
        self.shapes = cfg.cache_shapes()
        self.stores: list[list[torch.Tensor]] = [[] for _ in self.shapes]
        self.states: dict[int, list[torch.Tensor]] = {}
        self.free: list[int] = []

    def ensure(self, slots: int, capacity: int) -> None:
        new_slots, new_cap = max(self.slots, 1), max(self.capacity, 64)
        while new_slots < slots:
            new_slots *= 2
        while new_cap < capacity:
            new_cap *= 2
        if new_slots == self.slots and new_cap == self.capacity:
            return
        for s, (store, (_, width)) in enumerate(zip(self.stores, self.shapes, strict=True)):
            for i in range(self.cfg.layers):
                kept = self.cfg.cache_heads(i, s)
                fresh = torch.zeros((new_slots, kept, new_cap, width), dtype=self.dtype, device=self.device)
                if store[i:]:
                    fresh[: self.slots, :, : self.capacity] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        if self.cfg.gdn is not None and new_slots != self.slots:
            window, state = self.cfg.gdn.state_shapes()
            for i in range(self.cfg.layers):
                if not self.cfg.linear(i):
                    continue
                grown = [
                    torch.zeros((new_slots, *window), dtype=self.dtype, device=self.device),
                    torch.zeros((new_slots, *state), dtype=torch.float32, device=self.device),
                ]
                for new, old in zip(grown, self.states.get(i, []), strict=False):
                    new[: self.slots] = old
                self.states[i] = grown
        self.free.extend(range(self.slots, new_slots))
        self.slots, self.capacity = new_slots, new_cap

    def allocate(self, length: int) -> int:
        if not self.free:
            self.ensure(self.slots + 1, length)
        self.ensure(self.slots, length)
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()

    @property
    def nbytes(self) -> int:
        kv = sum(t.nbytes for store in self.stores for t in store)
        return kv + sum(t.nbytes for held in self.states.values() for t in held)


class TinyLM:
    """The forward pass over parameters held in a plain dict (HF names → tensors on `device`, in
    `dtype`: float32 on CPU; on CUDA also bfloat16 or float16)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, torch.Tensor],
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.params: dict[str, torch.Tensor] = {}
        # Flat receive buffers whose views are parameters (engine_receive's flattened buckets).
        self.arenas: dict[Hashable, torch.Tensor] = {}
        rot = cfg.rotary_dim or cfg.head_dim
        # Computed once in float32 on CPU; the copies the forward reads go with the weights.
        self._rope_tables = rope_tables(rot, cfg.rope_theta, cfg.max_position, cfg.rope_pairs, cfg.yarn)
        self.cos, self.sin = self._rope_tables
        self.load(params, complete=True)

    def load(self, named: dict[str, torch.Tensor], complete: bool) -> None:
        """Validate, then replace; a mismatch raises before any parameter changes. Routed experts
        stored fused (a published Qwen3.5-MoE checkpoint) are taken apart first."""
        named = unfuse_experts(named)
        check_named(self.cfg, named, complete)
        for name, tensor in named.items():
            self.assign(name, tensor)
        if self.cos.device != self.device or self.cos.dtype != self.dtype:
            self.cos, self.sin = (t.to(device=self.device, dtype=self.dtype) for t in self._rope_tables)

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        """Set one checked parameter, copying into the live tensor when there is one (no fresh
        allocation per update); a tied checkpoint's lm_head is dropped."""
        if self.ignores(name):
            return
        if is_fused_experts(name):  # each expert's slice, under its own name
            for each, part in unfuse_experts({name: tensor}).items():
                self.assign(each, part)
            return
        name = self.cfg.canonical(name)
        live = self.params.get(name)
        if live is not None and live.shape == tensor.shape:
            if live.data_ptr() != tensor.data_ptr():
                live.copy_(tensor.detach())
        else:
            # One copy, onto the device in the model's dtype (`copy`: never the caller's storage).
            self.params[name] = (
                tensor.detach().to(device=self.device, dtype=self.dtype, copy=True).contiguous()
            )

    def ignores(self, name: str) -> bool:
        """A tied checkpoint's lm_head (the embeddings serve as the head) or an MTP layer's
        tensor: accepted and dropped."""
        return self.cfg.unused(self.cfg.canonical(name))

    def adopt(self, name: str, tensor: torch.Tensor) -> None:
        """Make a checked tensor in the model's dtype, on its device, the parameter itself (it
        becomes the storage, no copy)."""
        if self.ignores(name):
            return
        if is_fused_experts(name):  # no single parameter to become: copied apart
            self.assign(name, tensor)
            return
        self.params[self.cfg.canonical(name)] = tensor

    def receive_target(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor | None:
        """The live parameter a broadcast of (name, dtype, shape) can land in directly, if any."""
        live = self.params.get(self.cfg.canonical(name))
        if live is None or live.dtype != dtype or list(live.shape) != list(shape) or not live.is_contiguous():
            return None
        return live

    def drop(self) -> None:
        """Let go of every parameter and the device's rope tables (memory released on request)."""
        self.params = {}
        self.arenas = {}
        self.cos, self.sin = self._rope_tables

    @property
    def nbytes(self) -> int:
        """Bytes the parameters hold (a storage shared by several counted once)."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.params.values()
        }
        return sum(storages.values())

    @property
    def loaded(self) -> bool:
        return bool(self.params)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm of x by the parameter `name`; Qwen3-Next's norms scale by 1 + weight."""
        weight = self.params[name]
        return _rms_norm(x, weight + 1.0 if self.cfg.zero_centered_norm else weight, self.cfg.eps)

    def _lm_head(self) -> torch.Tensor:
        key = "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"
        return self.params[key]

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, half: bool = False) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of x [B, heads, T, d] at positions pos [B, T]; `half`
        rotates halves where the model rotates pairs (DeepSeek-V3.2's indexer)."""
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        pairs = self.cfg.rope_pairs and not half
        if self.cfg.rope_pairs and half:  # the same angles, each once per half instead of per pair
            cos, sin = (torch.cat((t[..., 0::2], t[..., 0::2]), dim=-1) for t in (cos, sin))
        r = cos.shape[-1]
        rot = x[..., :r]
        rotate = _rotate_pairs if pairs else _rotate_half
        rot = rot * cos + rotate(rot) * sin
        return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)

    def _index_rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert self.cfg.dsa is not None
        return self._rope(x, pos, half=self.cfg.dsa.half_rope)

    def _project(
        self, i: int, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, dsa.IndexQuery | None]:
        """q [B, H, T, d], what the cache keeps ([B, heads, T, width] per store) for h [B, T, D],
        the output gate [B, T, H * d] when attention has one (Qwen3-Next), else None, and the
        sparse-attention indexer's queries on a layer that runs one, else None."""
        c, p = self.cfg, self.params
        if c.mla is not None:
            q, latent, q_latent = mla_project(c.mla, c.heads, p, i, h, pos, self._rope, _rms_norm)
            if c.dsa is None:
                return q, [latent], None, None
            assert q_latent is not None  # DSAConfig requires q_lora_rank
            keys = dsa.index_keys(c.dsa, p, i, h, pos, self._index_rope)
            return q, [latent, keys], None, dsa.index_query(c.dsa, p, i, h, q_latent, pos, self._index_rope)
        pre = f"model.layers.{i}.self_attn."
        b, t, _ = h.shape
        q = F.linear(h, p[pre + "q_proj.weight"], p.get(pre + "q_proj.bias"))
        gate = None
        if c.attn_output_gate:  # per head: its query's d dims, then its gate's
            q, gate = q.view(b, t, c.heads, 2 * c.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, t, c.heads * c.head_dim), gate.reshape(b, t, c.heads * c.head_dim)
        k = F.linear(h, p[pre + "k_proj.weight"], p.get(pre + "k_proj.bias"))
        v = F.linear(h, p[pre + "v_proj.weight"], p.get(pre + "v_proj.bias"))
        if c.qk_norm_full:  # one norm over all heads' queries (keys): MiniMax-M2
            q = _rms_norm(q, p[pre + "q_norm.weight"], c.eps)
            k = _rms_norm(k, p[pre + "k_norm.weight"], c.eps)
        q = q.view(b, t, c.heads, c.head_dim)
        k = k.view(b, t, c.kv_heads, c.head_dim)
        v = v.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm and not c.qk_norm_full:
            q = self._norm(q, pre + "q_norm.weight")
            k = self._norm(k, pre + "k_norm.weight")
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return self._rope(q, pos), [self._rope(k, pos), v], gate, None

    def _sparse_mask(
        self,
        i: int,
        index: dsa.IndexQuery | None,
        kept: list[torch.Tensor],
        valid: torch.Tensor,
        mask: torch.Tensor,
        chosen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's attention mask and the keys chosen so far: with sparse attention, only the
        keys its indexer picks among `valid` [B, T, S] (a layer with an indexer picks afresh over
        the cached indexer keys kept[1], a shared one reuses `chosen`); else `mask` as it is."""
        if self.cfg.dsa is None:
            return mask, chosen
        if index is not None:
            chosen = dsa.select(self.cfg.dsa, index, kept[1], valid)
        assert chosen is not None  # DSAConfig makes layer 0 run an indexer
        return _additive(chosen, self.dtype)[:, None], chosen

    def _attend(self, i: int, q: torch.Tensor, kept: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Attention output [B, T, H * v_dim] of q over the kept entries (this step's or the cache's)."""
        c = self.cfg
        if c.mla is not None:
            scale = c.mla.qk_dim**-0.5 * (c.yarn.mla_softmax_scale() if c.yarn is not None else 1.0)
            return mla_attend(c.mla, c.heads, self.params, i, q, kept[0], mask, scale)
        k, v = kept
        rep = c.heads // c.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # Written out rather than F.scaled_dot_product_attention: at the engine's small shapes
        # (a few query rows against tens of keys) three plain ops cost half the fused kernel.
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(c.head_dim**-0.5).add_(mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        b, _, t, _ = out.shape
        return out.transpose(1, 2).reshape(b, t, c.heads * c.head_dim)

    def _block_tail(
        self,
        i: int,
        x: torch.Tensor,
        attn: torch.Tensor,
        routes: Routes | None,
        gate: torch.Tensor | None = None,
        mixed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output projection (attention's, gated when `gate` is given; `mixed` instead is a linear
        attention layer's projected output), residuals, norms and the MLP (dense or MoE) of layer i."""
        c, p = self.cfg, self.params
        pre = f"model.layers.{i}."
        if mixed is not None:
            out = mixed
        else:
            if gate is not None:
                attn = attn * torch.sigmoid(gate)
            out = F.linear(attn, p[pre + "self_attn.o_proj.weight"])
        if c.sandwich_norm:
            out = _rms_norm(out, p[pre + "post_self_attn_layernorm.weight"], c.eps)
        x = x + out
        h = self._norm(x, pre + "post_attention_layernorm.weight")
        if c.moe is not None and c.sparse(i):
            y, ids = moe_block(c.moe, h, p, i)
            if routes is not None:
                routes[i] = ids
        elif c.fused_gate_up:
            gate, up = F.linear(h, p[pre + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
            y = F.linear(up * F.silu(gate), p[pre + "mlp.down_proj.weight"])
        else:
            gate = F.silu(F.linear(h, p[pre + "mlp.gate_proj.weight"]))
            y = F.linear(gate * F.linear(h, p[pre + "mlp.up_proj.weight"]), p[pre + "mlp.down_proj.weight"])
        if c.sandwich_norm:
            y = _rms_norm(y, p[pre + "post_mlp_layernorm.weight"], c.eps)
        return x + y

    def _linear_prefill(
        self,
        i: int,
        h: torch.Tensor,
        lens: torch.Tensor,
        where: torch.Tensor,
        slot_idx: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """Linear attention layer i over the distinct, right-padded sequences h [N, T, D]: its
        output [N, T, D] (zero past each sequence's end), and each sequence's conv window and
        recurrent state written to every slot that holds it (`where` maps slots to rows).

        Each sequence runs alone over its own length: a state run on through the padding would
        not be the state at the sequence's end."""
        c = self.cfg
        assert c.gdn is not None
        out = torch.zeros_like(h)
        windows, states = [], []
        for row, n in enumerate(lens.tolist()):
            y, window, state = gdn.prefill(c.gdn, self.params, i, h[row : row + 1, :n], c.eps)
            out[row, :n] = y[0]
            windows.append(window)
            states.append(state)
        window_store, state_store = cache.states[i]
        window_store[slot_idx] = torch.cat(windows)[where]
        state_store[slot_idx] = torch.cat(states)[where]
        return out

    def prefill(
        self,
        prompts: list[list[int]],
        slots: list[int],
        cache: KVCache,
        routes: Routes | None = None,
        score_from: dict[int, int] | None = None,
        scores: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run whole prompts (right-padded into one batch), fill their slots; last-token logits [B, V].

        `routes`, when given, receives each MoE layer's expert ids [B, T, k] (padded rows too).
        `score_from` maps a row to the first position whose logits it also wants (prompt scoring,
        SGLang's logprob_start_len); prefill writes that row's logits [len - start, V] to `scores`."""
        c = self.cfg
        # The n samples of a group share their prompt: each distinct sequence runs once and its
        # keys and values go to every slot that holds it (what SGLang's prefix cache saves too).
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts]
        shared = len(distinct) < len(prompts)
        dev = self.device
        where = torch.tensor(inverse, device=dev)
        lens = torch.tensor([len(ids) for ids in distinct], device=dev)
        t = max(len(ids) for ids in distinct)
        tokens = torch.zeros(len(distinct), t, dtype=torch.long)
        for row, ids in enumerate(distinct):
            tokens[row, : len(ids)] = torch.tensor(ids)
        tokens = tokens.to(dev)  # built on the host, moved in one copy
        pos = torch.arange(t, device=dev).expand(len(distinct), t)
        key_valid = torch.arange(t, device=dev)[None, :] < lens[:, None]
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        valid = causal[None] & key_valid[:, None, :]  # [N, T, T]
        mask = _additive(valid, self.dtype)[:, None]
        chosen: torch.Tensor | None = None  # the last indexer's keys per query (sparse attention)
        slot_idx = torch.tensor(slots, device=dev)
        x = F.embedding(tokens, self.params["model.embed_tokens.weight"])
        for i in range(c.layers):
            h = self._norm(x, f"model.layers.{i}.input_layernorm.weight")
            if c.linear(i):
                x = self._block_tail(
                    i, x, x, routes, mixed=self._linear_prefill(i, h, lens, where, slot_idx, cache)
                )
                continue
            q, entries, gate, index = self._project(i, h, pos)
            for store, entry in zip(cache.stores, entries, strict=True):
                # The whole padded block in one copy: a slot's positions past its sequence get
                # padding's entries, which decode overwrites before its mask lets a query see them.
                store[i][slot_idx, :, :t] = entry[where] if shared else entry
            layer_mask, chosen = self._sparse_mask(i, index, entries, valid, mask, chosen)
            x = self._block_tail(i, x, self._attend(i, q, entries, layer_mask), routes, gate)
        if routes is not None and shared:
            for layer, experts in routes.items():
                routes[layer] = experts[where]
        if score_from and scores is not None:
            for row, start in score_from.items():
                h = self._norm(x[inverse[row], start : len(prompts[row])], "model.norm.weight")
                scores[row] = F.linear(h, self._lm_head())
        last = x[torch.arange(len(distinct), device=dev), lens - 1]
        logits = F.linear(self._norm(last, "model.norm.weight"), self._lm_head())
        return logits[where] if shared else logits

    def decode(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        cache: KVCache,
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """One step for every running sequence at once: next-token logits [B, V].

        `routes`, when given, receives each MoE layer's expert ids [B, 1, k]."""
        c = self.cfg
        b = len(tokens)
        dev = self.device
        slot_idx = torch.tensor(slots, device=dev)
        # A batch admitted together holds consecutive slots: their cache rows are read in place
        # (a view) instead of gathered into a copy every layer and step.
        first = slots[0]
        consecutive = slots == list(range(first, first + b))
        pos = torch.tensor(positions, device=dev)
        t = max(positions) + 1
        seen = torch.arange(t, device=dev)[None, :] <= pos[:, None]
        mask = _additive(seen, self.dtype)[:, None, None, :]  # [B, 1, 1, T]
        chosen: torch.Tensor | None = None  # the last indexer's keys (sparse attention)
        x = F.embedding(torch.tensor(tokens, device=dev).view(b, 1), self.params["model.embed_tokens.weight"])
        for i in range(c.layers):
            h = self._norm(x, f"model.layers.{i}.input_layernorm.weight")
            if c.gdn is not None and c.linear(i):
                window, state = cache.states[i]
                mixed, window_new, state_new = gdn.decode(
                    c.gdn, self.params, i, h, window[slot_idx], state[slot_idx], c.eps
                )
                window[slot_idx], state[slot_idx] = window_new, state_new
                x = self._block_tail(i, x, x, routes, mixed=mixed)
                continue
            q, entries, gate, index = self._project(i, h, pos.view(b, 1))
            kept = []
            for store, entry in zip(cache.stores, entries, strict=True):
                store[i][slot_idx, :, pos] = entry[:, :, 0]
                known = store[i][:, :, :t]
                kept.append(known[first : first + b] if consecutive else known.index_select(0, slot_idx))
            layer_mask, chosen = self._sparse_mask(i, index, kept, seen[:, None], mask, chosen)
            x = self._block_tail(i, x, self._attend(i, q, kept, layer_mask), routes, gate)
        return F.linear(self._norm(x[:, 0], "model.norm.weight"), self._lm_head())

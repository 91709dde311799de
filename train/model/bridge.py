"""Hugging Face ↔ Megatron through mbridge: the TransformerConfig, the layer spec, HF weights into this
rank's model chunk and back out under HF names, for every family tether builds (`hf_config`).

mbridge (the bridge slime uses) supplies, per family, the HF → Megatron config mapping and the
weight-name and tensor-layout conversions (QKV grouping, gate/up fusion, experts, MLA projections,
TP splits and merges). tether uses them with its own model and loop:

- Config: mbridge's kwargs, then the HF facts its configs drop or get wrong for tether's families
  (`_restored_facts`: norm_topk_prob, n_group/topk_group, first_k_dense_replace and Qwen-MoE's
  sparse steps, the shared-expert gate, YaRN, partial and interleaved RoPE, GLM's attention bias),
  then CPU-safe kernel settings, then the run's own flag kwargs (`megatron_args`): flags keep
  Megatron's meaning.
- Layer spec: TransformerEngine's when the rank uses it, else Megatron's local spec with the same
  modules (experts, MLA, qk-norm); its norms accept sequence parallelism and MLA has a core attention
  (`spec`, beside this module). GLM-4 dense's layers carry their extra output norms under both (`glm4`).
- Families: mbridge's registry, plus tether's glm4 bridge (`glm4`), which mbridge lacks; GLM-4.7-Flash
  (`glm4_moe_lite`) and Kimi-K2 (`kimi_k2`) take mbridge's DeepSeek-V3 bridge, GLM-5 and DeepSeek-V3.2
  that bridge with their sparse-attention indexers (`dsa`).
- Names: mbridge maps TransformerEngine's parameter names. The local spec names a few parameters
  differently (separate input/pre-MLP norms, MLA's q/kv norms, SequentialMLP's experts);
  `te_name` rewrites them to the names mbridge knows.
- Loading reads each parameter's HF tensors on every rank and keeps this rank's TP slice (no
  collectives); export gathers TP (and expert-parallel) shards per parameter, so every rank of a
  stage iterates it, like mbridge's `export_weights`, but each stage exports only its own layers.

mbridge is used through these call sites only; where it is patched, the patch says why in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tether.train.model.families.dsa import dsa_bridge_class
from tether.train.model.families.glm4 import glm4_bridge_class, with_post_sublayer_norms
from tether.train.model.families.minimax_m2 import minimax_m2_bridge_class, with_full_qk_norms
from tether.train.model.families.qwen3_5 import qwen3_5_bridge_class
from tether.train.model.families.qwen3_next import qwen3_next_bridge_class, with_gated_delta_net
from tether.train.model.hf_config import (
    DSA_MODEL_TYPES,
    MLA_MODEL_TYPES,
    QWEN3_5_MODEL_TYPES,
    TEXT_ONLY_MODEL_TYPES,
    ModelArch,
    transformer_shape,
)
from tether.train.model.hf_convert import HFWeights
from tether.train.model.mbridge_import import defer_mbridge, family_modules, register_families
from tether.train.model.megatron_cpu import quiet_megatron_imports

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# An MTP layer's own weights (beside its transformer layer), by family: HF name under the layer's prefix.
_MTP_OWN = {
    "mimo": {
        "enorm.weight": "token_layernorm.weight",
        "hnorm.weight": "hidden_layernorm.weight",
        "eh_proj.weight": "input_proj.weight",
        "final_layernorm.weight": "final_layernorm.weight",
    },
    "deepseek_v3": {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight",
    },
}
_MTP_OWN.update({family: _MTP_OWN["deepseek_v3"] for family in ("glm4_moe", *MLA_MODEL_TYPES)})

# Settings mbridge asks for that need TransformerEngine/CUDA kernels or change training; tether sets
# them from the flags (megatron_args) and the rank's capabilities instead.
_CPU_SAFE: dict[str, Any] = {
    "persist_layer_norm": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "moe_grouped_gemm": False,
    "moe_shared_expert_overlap": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    "disable_bf16_reduced_precision_matmul": False,
    # Off: HF weights overwrite every parameter. Megatron then leaves its TP layers' weights
    # without TP attributes; tether.train.model.build.mark_tensor_parallel_params sets them.
    "perform_initialization": False,
    "variable_seq_lengths": False,  # step.run_schedule sets it per schedule (PP exchanges shapes)
    # Megatron's default "full" means [] and warns on every config it builds.
    "cuda_graph_scope": [],
    # Multi-token prediction layers: built only with --mtp-num-layers (megatron_args sets it), not
    # from the checkpoint's num_nextn_predict_layers as mbridge would.
    "mtp_num_layers": None,
}
# mbridge's RL-flavoured MoE knobs; tether takes them from the flags, with Megatron's defaults.
_FLAG_KNOBS = (
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_token_dispatcher_type",
    "moe_router_dtype",
    "moe_router_bias_update_rate",
    "attention_backend",
)


# tether's own bridges, for the families mbridge 0.15.1 lacks (mbridge's win where it has one).
_TETHER_BRIDGES: dict[str, Callable[[], Any]] = {
    "glm4": glm4_bridge_class,
    "minimax_m2": minimax_m2_bridge_class,
    "qwen3_next": qwen3_next_bridge_class,
    # the sparse-attention families: DeepSeek-V3's bridge with their indexer's tensors
    **dict.fromkeys(DSA_MODEL_TYPES, dsa_bridge_class),
}


def _bridge_class(model_type: str) -> Any | None:
    """The bridge class for `model_type`: mbridge's where its sources register one (only that
    module imported, see `mbridge_import`), else tether's own, else, for GLM-4.7-Flash and Kimi-K2
    (DeepSeek-V3's decoder under DeepSeek-V3's HF names, as slime loads and converts them),
    mbridge's DeepSeek-V3 bridge; tether's restored facts set what differs. None: no bridge."""
    with quiet_megatron_imports():
        if model_type not in family_modules():
            if model_type in _TETHER_BRIDGES:
                return _TETHER_BRIDGES[model_type]()
            if model_type in MLA_MODEL_TYPES:
                model_type = "deepseek_v3"
        register_families([model_type])  # a type no source names: all of mbridge, as before
        from mbridge.core.bridge import _MODEL_REGISTRY
    return _MODEL_REGISTRY.get(model_type)


def hf_config(hf_dir: str | Path) -> Any:
    """transformers' config of `hf_dir`, with the fields mbridge reads where it reads them.

    transformers 5 keeps RoPE's base in `rope_parameters`; mbridge reads `config.rope_theta`.
    GLM-4.7-Flash's config may state its dense layers only as `mlp_layer_types`; mbridge's
    DeepSeek-V3 bridge reads `first_k_dense_replace` (its MoE pattern, which `_restored_facts`
    replaces). Set on this config object only.
    """
    from transformers import AutoConfig, DeepseekV3Config, Qwen2Config

    model_type = load_arch_type(hf_dir)
    cfg: Any
    if model_type == "mimo":
        # MiMo has no transformers config class (its checkpoints ship remote code); its decoder is
        # Qwen2's, and mbridge's mimo bridge reads Qwen2's fields plus num_nextn_predict_layers.
        cfg = Qwen2Config.from_pretrained(str(hf_dir))  # the bridge is picked by ModelArch.model_type
    elif model_type == "kimi_k2":
        # Kimi-K2 has no transformers config class either (remote code); its config.json is
        # DeepSeek-V3's (architectures DeepseekV3ForCausalLM), with model_type kimi_k2 kept.
        cfg = DeepseekV3Config.from_pretrained(str(hf_dir))
    else:
        cfg = AutoConfig.from_pretrained(str(hf_dir))
    if model_type in QWEN3_5_MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        # Published with a vision tower: mbridge reads the language model's fields (hf_config.language_model_config).
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        cfg = cfg.text_config
        cfg.tie_word_embeddings = tied
        if getattr(cfg, "intermediate_size", None) is None:  # MoE: every layer's FFN is the experts'
            cfg.intermediate_size = cfg.moe_intermediate_size
    if model_type in TEXT_ONLY_MODEL_TYPES:
        cfg.model_type = TEXT_ONLY_MODEL_TYPES[model_type]
    params = getattr(cfg, "rope_parameters", None) or {}
    if getattr(cfg, "rope_theta", None) is None and "rope_theta" in params:
        cfg.rope_theta = params["rope_theta"]
    layer_types = getattr(cfg, "mlp_layer_types", None)
    if getattr(cfg, "first_k_dense_replace", None) is None and isinstance(layer_types, list):
        dense = [t == "dense" for t in layer_types]
        cfg.first_k_dense_replace = dense.index(False) if False in dense else len(dense)
    return cfg


def load_arch_type(hf_dir: str | Path) -> str | None:
    """config.json's model_type (None when absent or unreadable: transformers then explains)."""
    import json

    try:
        value = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def parallel_states(*, tp_size: int, pp_size: int, ep_size: int = 1, etp_size: int | None = None) -> Any:
    """mbridge's record of the layout (sizes only: what its config mapping and TP merges read)."""
    defer_mbridge()  # this module alone, not every family's bridge (see mbridge_import)
    with quiet_megatron_imports():
        from mbridge.core.parallel_states import ParallelStates

    return ParallelStates(
        tp_size=tp_size,
        pp_size=pp_size,
        vpp_size=None,  # type: ignore[arg-type]
        ep_size=ep_size,
        etp_size=etp_size if etp_size is not None else tp_size,
    )


def open_bridge(arch: ModelArch, hf: Any, *, dtype: torch.dtype, parallel: Any) -> Any:
    """mbridge's bridge of this family, its config kept as keyword arguments (see `config_kwargs`)."""
    base: Any
    if arch.model_type in QWEN3_5_MODEL_TYPES:  # one class per checkpoint prefix and MLP kind
        base = qwen3_5_bridge_class(arch.hf_prefix, arch.is_moe)
    else:
        base = _bridge_class(arch.model_type)
    if base is None:
        raise KeyError(f"mbridge 0.15.1 has no bridge for model_type {arch.model_type!r}")
    # Patch (Bridge.__init__ → _build_config → TransformerConfigClass(**kwargs)): keep mbridge's
    # HF→Megatron kwargs as a dict, so tether corrects them before Megatron validates a config.
    # A fresh subclass per bridge also gives Qwen2's tied-embedding remap (which mutates the class's
    # _DIRECT_MAPPING) a copy of its own.
    cls = type(
        f"Tether{base.__name__}",
        (base,),
        {"TransformerConfigClass": staticmethod(dict), "_DIRECT_MAPPING": dict(base._DIRECT_MAPPING)},
    )
    with quiet_megatron_imports():
        return cls(hf, dtype=dtype, parallel_states=parallel)


def _restored_facts(arch: ModelArch) -> dict[str, Any]:
    """The HF facts mbridge's configs drop or set differently from the HF model (each measured
    against transformers' logits in tests/integration/test_train_model.py)."""
    facts: dict[str, Any] = {
        **transformer_shape(arch),
        "layernorm_epsilon": arch.norm_epsilon,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_layernorm or arch.multi_latent_attention,
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "rotary_percent": arch.rotary_percent,
        "rotary_interleaved": arch.rotary_interleaved,
    }
    if arch.is_moe:
        assert arch.moe_layer_freq is not None
        facts.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=arch.moe_shared_expert_gate,
            moe_layer_freq=list(arch.moe_layer_freq),
            moe_router_score_function=arch.moe_router_score_function,
            moe_router_pre_softmax=arch.moe_router_pre_softmax,
            moe_router_num_groups=arch.moe_router_num_groups,
            moe_router_group_topk=arch.moe_router_group_topk,
            moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor,
            moe_router_enable_expert_bias=arch.moe_router_enable_expert_bias,
        )
    if arch.zero_centered_norms:
        facts["layernorm_zero_centered_gamma"] = True
    if arch.attention_output_gate:
        facts["attention_output_gate"] = True
    if arch.linear_attention is not None:
        facts.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=list(arch.linear_attention),
            linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
            linear_key_head_dim=arch.linear_key_head_dim,
            linear_value_head_dim=arch.linear_value_head_dim,
            linear_num_key_heads=arch.linear_num_key_heads,
            linear_num_value_heads=arch.linear_num_value_heads,
        )
    if arch.multi_latent_attention:
        facts.update(
            multi_latent_attention=True,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_head_dim,
            qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim,
            v_head_dim=arch.v_head_dim,
            rotary_base=arch.rope_theta,
            rope_type="yarn" if arch.yarn else "rope",
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        )
        if arch.yarn:
            facts.update(dict(arch.yarn))
    return facts


def config_kwargs(base: dict[str, Any], arch: ModelArch, overrides: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields: mbridge's mapping (`base`, from `open_bridge(...).config`; empty
    where no HF directory is at hand) < restored HF facts < CPU-safe kernels < the run's flags
    (`overrides`, from `megatron_args.transformer_config_kwargs` plus the layout)."""
    import torch.nn.functional as F

    fields = {k: v for k, v in base.items() if k not in _FLAG_KNOBS}
    fields.update(_restored_facts(arch))
    fields["activation_func"] = F.silu
    fields.update(_CPU_SAFE)
    fields["use_cpu_initialization"] = not torch.cuda.is_available()
    fields.update(overrides)
    if not arch.is_moe:
        for key in [k for k in fields if k.startswith("moe_")]:
            fields.pop(key)
    params_dtype = fields.get("params_dtype", torch.float32)
    fields.update(
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    if not arch.multi_latent_attention:
        for key in (
            "rope_type",
            "rotary_scaling_factor",
            "mscale",
            "mscale_all_dim",
            "beta_fast",
            "beta_slow",
            "original_max_position_embeddings",
        ):
            fields.pop(key, None)
    # GPTModel's arguments, not TransformerConfig fields (MLA's config has its own RoPE fields).
    fields.pop("max_position_embeddings", None)
    if not arch.multi_latent_attention:
        fields.pop("rotary_base", None)
        fields.pop("rotary_percent", None)
    return fields


def build_config(arch: ModelArch, fields: dict[str, Any]) -> Any:
    """Megatron's TransformerConfig (MLATransformerConfig for multi-latent attention)."""
    with quiet_megatron_imports():
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if arch.multi_latent_attention else TransformerConfig
    cp = int(fields.get("context_parallel_size") or 1)
    if arch.linear_attention is not None and cp > 1:
        # megatron-core 0.16 asserts CP == 1 for GatedDeltaNet; tether runs its sequence mixing over
        # the gathered sequence (families.qwen3_next.over_context), so the config says CP after.
        config = cls(**{**fields, "context_parallel_size": 1})
        config.context_parallel_size = cp
        return config
    return cls(**fields)


def _fix_router_without_te() -> None:
    """Patch (megatron/core/transformer/moe/moe_utils.py, RouterGatingLinearFunction): megatron-core
    0.16.1 tests `te_general_gemm is not None` but defines the name only when TransformerEngine
    imports; define it as None there, so the router's linear falls back to torch.mm as intended."""
    with quiet_megatron_imports():
        from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _fix_alltoall_without_cuda() -> None:
    """Patch (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher): the
    alltoall dispatcher moves its split sizes to the host on a side CUDA stream; on a CPU rank they
    are on the host already, so skip the stream and only turn the split sizes into the host arrays
    the all-to-all takes (what the CUDA path ends with)."""
    if torch.cuda.is_available():
        return
    with quiet_megatron_imports():
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher: Any = MoEAlltoAllTokenDispatcher
    if getattr(dispatcher, "_tether_host_splits", False):
        return

    def host_splits(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    dispatcher.cuda_dtoh_stream = False  # not None: __init__ would create a CUDA stream
    dispatcher._maybe_dtoh_and_synchronize = host_splits
    dispatcher._tether_host_splits = True


def _fix_mla_without_te() -> None:
    """Patch (megatron/core/transformer/multi_latent_attention.py, HAVE_TE): megatron-core 0.16.1
    imports its TE extension module there, which imports without TE (it mocks `te`), so MLA believes
    TE is present and `isinstance(..., TELinear)` fails on the mock; tell MLA what the extension knows."""
    with quiet_megatron_imports():
        from megatron.core.extensions import transformer_engine as te_extension
        from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE:
        multi_latent_attention.HAVE_TE = False  # type: ignore[attr-defined]


def layer_spec(
    config: Any,
    transformer_engine: bool,
    pp_rank: int,
    post_sublayer_norms: bool = False,
    full_qk_norms: bool = False,
) -> Any:
    """Pipeline stage `pp_rank`'s block spec: per layer dense or MoE (moe_layer_freq), MLA or not,
    qk-norm, GLM-4's norms of attention's and the MLP's outputs (`post_sublayer_norms`, under
    either spec: `glm4`), MiniMax-M2's QK norms over all heads (`full_qk_norms`: `minimax_m2`) and
    Qwen3-Next's linear-attention layers (config.linear_attention_freq, local spec: `qwen3_next`)."""
    with quiet_megatron_imports():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if config.num_moe_experts:
        _fix_router_without_te()
        _fix_alltoall_without_cuda()
    if config.multi_latent_attention:
        _fix_mla_without_te()

    from tether.train.model.spec import local_spec

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=transformer_engine, normalization="RMSNorm", pp_rank=pp_rank
    )
    if post_sublayer_norms:
        spec = with_post_sublayer_norms(spec)
    if full_qk_norms:
        spec = with_full_qk_norms(spec)
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        spec = with_gated_delta_net(spec, config, transformer_engine, pp_rank)
    if transformer_engine:
        return spec
    return local_spec(
        spec,
        bool(config.multi_latent_attention),
        context_parallel=int(getattr(config, "context_parallel_size", 1) or 1) > 1,
    )


def mtp_block_spec(config: Any, spec: Any, transformer_engine: bool, pp_rank: int) -> Any:
    """Megatron's MTP block spec for --mtp-num-layers (None when unset, and on every stage but the
    last): each MTP layer's transformer layer is shaped like `spec`'s last decoder layer."""
    if not config.mtp_num_layers:
        return None
    with quiet_megatron_imports():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from tether.train.model.spec import local_spec

    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=transformer_engine, pp_rank=pp_rank)
    # The MTP layers' own norms come from Megatron's local provider: swap them like the decoder's
    # (their transformer layer is the decoder's, already local).
    return mtp if transformer_engine or mtp is None else local_spec(mtp, multi_latent_attention=False)


def mtp_proxy_name(name: str, num_layers: int) -> str:
    """An MTP layer's transformer-layer weight under the name of the decoder layer that follows the
    last one (`mtp.layers.{i}.transformer_layer.X` → `decoder.layers.{num_layers + i}.X`), which is
    where DeepSeek-V3 and GLM-4.5 keep it in HF (MiMo: `model.mtp_layers.{i}`, see `mtp_hf_name`), so
    mbridge's decoder-layer conversions apply; other names are returned as they are."""
    m = _MTP.match(name)
    if m and m.group(2).startswith("transformer_layer."):
        return (
            f"decoder.layers.{num_layers + int(m.group(1))}.{m.group(2).removeprefix('transformer_layer.')}"
        )
    return name


def mtp_hf_name(hf_name: str, arch: ModelArch) -> str:
    """MiMo keeps MTP layer i's transformer layer under `model.mtp_layers.{i}` instead of the HF
    decoder layer `num_layers + i` (`mtp_proxy_name`); the other families keep it there."""
    if arch.model_type != "mimo" or not hf_name.startswith("model.layers."):
        return hf_name
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    if int(layer) < arch.num_layers:
        return hf_name
    return f"model.mtp_layers.{int(layer) - arch.num_layers}.{rest}"


def mtp_eh_proj_layout(name: str, tensor: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """MiMo's `input_proj` reads [hidden_layernorm(h), token_layernorm(e)] (SGLang's MiMo MTP
    layer), Megatron's `eh_proj` [enorm(e), hnorm(h)] (as DeepSeek's eh_proj): for MiMo the two
    column halves swap between the layouts (the same swap both ways). slime's and mbridge's MiMo
    conversions copy the tensor as it is; then Megatron's MTP layer would not compute the
    checkpoint's. Other tensors are returned as they are."""
    if arch.model_type != "mimo" or not (_MTP.match(name) and name.endswith(".eh_proj.weight")):
        return tensor
    half = tensor.shape[-1] // 2
    return torch.cat([tensor[..., half:], tensor[..., :half]], dim=-1)


def mtp_own_hf_name(name: str, arch: ModelArch) -> str | None:
    """HF name of an MTP layer's own weight (`mtp.layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}`),
    None for any other name."""
    m = _MTP.match(name)
    if not m or m.group(2).startswith("transformer_layer."):
        return None
    own = _MTP_OWN.get(arch.model_type, {})
    if m.group(2) not in own:
        raise ValueError(f"{name}: no HF name for this MTP weight in {arch.model_type}")
    i = int(m.group(1))
    prefix = f"model.mtp_layers.{i}." if arch.model_type == "mimo" else f"model.layers.{arch.num_layers + i}."
    return prefix + own[m.group(2)]


@dataclass(frozen=True)
class Layout:
    """This rank's place in the groups that shard weights."""

    tp_rank: int
    tp_size: int
    etp_rank: int
    etp_size: int
    ep_rank: int
    ep_size: int
    tp_group: Any = None
    etp_group: Any = None
    ep_group: Any = None

    @classmethod
    def current(cls) -> Layout:
        """From Megatron's parallel state (initialised by `tether.train.parallel.topology`)."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
        )


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def te_name(global_name: str, arch: ModelArch, moe_layers: set[int], expert_offset: int = 0) -> str:
    """The TransformerEngine-spec name mbridge maps, for a (global-layer) parameter name.

    Under the local spec the input norm and, on dense layers, the pre-MLP norm are modules of their
    own (TE fuses them into linear_qkv / linear_fc1 as `layer_norm_weight`); MLA's q/kv norms are
    `q_layernorm`/`kv_layernorm` (TE: fused into linear_q_up_proj / linear_kv_up_proj); each
    SequentialMLP expert is `local_experts.{i}.linear_fc*` (TE's grouped GEMM: `linear_fc*.weight{i}`),
    numbered here globally (`expert_offset`: this expert-parallel rank's first expert).
    """
    m = _LAYER.match(global_name)
    if not m:
        return global_name
    layer, rest = int(m.group(1)), m.group(2)
    expert = _LOCAL_EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.{expert.group(2)}.{expert.group(3)}{int(expert.group(1)) + expert_offset}"
    else:
        grouped = _GROUPED_EXPERT.match(rest)
        if grouped:
            rest = f"mlp.experts.{grouped.group(1)}.{grouped.group(2)}{int(grouped.group(3)) + expert_offset}"
        elif rest == "input_layernorm.weight" and not arch.multi_latent_attention:
            rest = "self_attention.linear_qkv.layer_norm_weight"
        elif rest == "pre_mlp_layernorm.weight" and layer not in moe_layers:
            rest = "mlp.linear_fc1.layer_norm_weight"
        elif rest == "self_attention.q_layernorm.weight" and arch.multi_latent_attention:
            rest = "self_attention.linear_q_up_proj.layer_norm_weight"
        elif rest == "self_attention.kv_layernorm.weight" and arch.multi_latent_attention:
            rest = "self_attention.linear_kv_up_proj.layer_norm_weight"
    return f"decoder.layers.{layer}.{rest}"


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP/Float16 wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def chunk_tensors(chunk: Any) -> list[tuple[str, torch.Tensor]]:
    """(local name, tensor) of every weight the HF checkpoint holds: parameters, and the routers'
    expert_bias buffers (DeepSeek's e_score_correction_bias), which are not parameters."""
    module = unwrap(chunk)
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    out += [(n, b) for n, b in module.named_buffers() if n.endswith("router.expert_bias")]
    return out


def _global_names(chunk: Any, names: list[str]) -> dict[str, str]:
    """Chunk-local layer numbers → global ones (Megatron's own layer offsets)."""
    numbers = [int(layer.layer_number) - 1 for layer in unwrap(chunk).decoder.layers]
    out = {}
    for name in names:
        m = _LAYER.match(name)
        out[name] = f"decoder.layers.{numbers[int(m.group(1))]}.{m.group(2)}" if m else name
    return out


def _moe_layers(global_names: list[str]) -> set[int]:
    layers = set()
    for name in global_names:
        m = _LAYER.match(name)
        if m and m.group(2).startswith("mlp.router."):
            layers.add(int(m.group(1)))
    return layers


@dataclass
class WeightBridge:
    """mbridge's conversions for one model, with tether's vocabulary padding and tied embeddings."""

    arch: ModelArch
    bridge: Any
    padded_vocab_size: int
    config: Any
    """The TransformerConfig the model was built with (mbridge's merges and DeepSeek's MTP check read it)."""

    def __post_init__(self) -> None:
        self.bridge.config = self.config
        # mbridge pads/trims the embedding and output rows when these are set (Bridge._weight_to_*).
        self.bridge.vocab_size = self.arch.vocab_size
        self.bridge.padded_vocab_size = self.padded_vocab_size
        self.bridge.make_vocab_size_divisible_by = self.padded_vocab_size

    def hf_names(self, name: str) -> list[str]:
        if name == "output_layer.weight" and self.arch.tie_word_embeddings:
            # With tied embeddings the last PP stage holds its own copy of the embedding.
            return [self.arch.hf_prefix + "embed_tokens.weight"]
        own = mtp_own_hf_name(name, self.arch)
        if own is not None:
            return [own]
        return [mtp_hf_name(n, self.arch) for n in self.bridge._weight_name_mapping_mcore_to_hf(name)]

    def names(self, chunk: Any, layout: Layout) -> list[tuple[str, str, torch.Tensor]]:
        """(local name, mbridge name, tensor) of every weight of `chunk`."""
        tensors = chunk_tensors(chunk)
        global_names = {
            n: mtp_proxy_name(g, self.arch.num_layers)
            for n, g in _global_names(chunk, [n for n, _ in tensors]).items()
        }
        moe = _moe_layers(list(global_names.values()))
        per_rank = (self.arch.num_experts or 0) // max(layout.ep_size, 1)
        offset = layout.ep_rank * per_rank
        return [(n, te_name(global_names[n], self.arch, moe, offset), t) for n, t in tensors]

    def load(
        self, chunk: Any, weights: HFWeights, layout: Layout, only: Collection[str] | None = None
    ) -> int:
        """Copy this rank's slice of every weight of `chunk` (those named in `only`, when given) from
        the HF checkpoint; returns the count."""
        count = 0
        with torch.no_grad():
            for local, name, tensor in self.names(chunk, layout):
                if only is not None and local not in only:
                    continue
                hf = [weights.get(n) for n in self.hf_names(name)]
                # An MTP layer's own weights are single HF tensors in Megatron's layout.
                own = mtp_own_hf_name(name, self.arch) is not None
                full = (
                    mtp_eh_proj_layout(name, hf[0], self.arch)
                    if own
                    else self.bridge._weight_to_mcore_format(name, hf)
                )
                size, rank = (
                    (layout.etp_size, layout.etp_rank)
                    if _is_expert(name)
                    else (layout.tp_size, layout.tp_rank)
                )
                shard = self.bridge._weight_split_across_tp(name, full, tensor, size)[rank]
                if tuple(shard.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{local}: HF {self.hf_names(name)} give shard shape {tuple(shard.shape)}, "
                        f"Megatron expects {tuple(tensor.shape)}"
                    )
                tensor.copy_(shard.to(tensor.dtype))
                count += 1
        return count

    def export(self, chunk: Any, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight of this stage's chunk; collective over the TP group
        (and the expert groups for experts), so every rank of the stage must iterate to the end."""
        first_stage = bool(getattr(unwrap(chunk), "pre_process", True))
        for _local, name, tensor in self.names(chunk, layout):
            if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                continue  # the first stage exports the embedding; at PP=1 this tensor does not exist
            if name == "embedding.word_embeddings.weight" and not first_stage:
                continue  # the MTP block's copy of the embedding on the last stage (the first exports it)
            if _is_expert(name):
                yield from self._export_expert(name, tensor, layout)
                continue
            full = tensor.detach()
            if getattr(tensor, "tensor_model_parallel", False) and layout.tp_size > 1:
                full = self.bridge._weight_merge_across_tp(
                    name, _gather(full, layout.tp_group, layout.tp_size), tensor
                )
            own = mtp_own_hf_name(name, self.arch)
            if own is not None:
                yield own, mtp_eh_proj_layout(name, full, self.arch)
                continue
            names, values = self.bridge._weight_to_hf_format(name, full)
            yield from zip([mtp_hf_name(n, self.arch) for n in names], values, strict=True)

    def _export_expert(
        self, name: str, tensor: torch.Tensor, layout: Layout
    ) -> Iterator[tuple[str, torch.Tensor]]:
        local = tensor.detach()
        per_ep = _gather(local, layout.ep_group, layout.ep_size)
        m = _LAYER.match(name)
        assert m is not None
        grouped = _GROUPED_EXPERT.match(m.group(2))
        assert grouped is not None
        first = int(grouped.group(3)) - layout.ep_rank * ((self.arch.num_experts or 0) // layout.ep_size)
        per_rank = (self.arch.num_experts or 0) // layout.ep_size
        for ep_rank, shard in enumerate(per_ep):
            expert = first + ep_rank * per_rank
            global_name = (
                f"decoder.layers.{m.group(1)}.mlp.experts.{grouped.group(1)}.{grouped.group(2)}{expert}"
            )
            full = shard
            if layout.etp_size > 1:
                full = self.bridge._weight_merge_across_tp(
                    global_name, _gather(shard.contiguous(), layout.etp_group, layout.etp_size), tensor
                )
            names, values = self.bridge._weight_to_hf_format(global_name, full)
            yield from zip([mtp_hf_name(n, self.arch) for n in names], values, strict=True)


_ATTR = "_tether_weight_bridge"


def attach(chunk: Any, weights: WeightBridge) -> None:
    """Keep the chunk's bridge on its GPTModel, so export finds it from the chunks alone."""
    setattr(unwrap(chunk), _ATTR, weights)


def weights_of(chunk: Any) -> WeightBridge:
    found = getattr(unwrap(chunk), _ATTR, None)
    if found is None:
        raise ValueError("this model chunk was not built by tether.train.model.build (no weight bridge)")
    return found


def _gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    local = tensor.contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards

"""A tiny Megatron MoE GPTModel for routing-replay tests, built straight from megatron-core
(local layer spec, 4 experts, top-2), independent of tether's model builder."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
EXPERTS = 4
TOPK = 2


def cpu_moe_fixes() -> None:
    """megatron-core 0.16.1 without TransformerEngine: the router's gating function reads a
    module global that only exists when TE imports (`te_general_gemm`); None makes it use torch."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_config(layers: int = 2, *, pp: int = 1, **overrides: Any) -> Any:
    """TransformerConfig of a small MoE GPT: every layer MoE (allgather dispatcher: CPU-safe)."""
    from megatron.core.transformer import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_scope=[],  # megatron's default ("full") warns that it is deprecated
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def moe_model(config: Any, *, pre_process: bool = True, post_process: bool = True, seed: int = 0) -> Any:
    """The GPTModel for `config` with weights drawn from `seed` (the same on every rank)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cpu_moe_fixes()
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        parallel_output=True,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            # Distinct scales per tensor so routers route unevenly and experts differ.
            p.copy_(
                0.3 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("layernorm.weight") else 0.0)
            )
    return model


def routers(model: Any) -> list[Any]:
    """The model's TopKRouter modules, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]

"""MiniMax-M2 (HF model_type `minimax_m2`) in megatron-core 0.16 through mbridge 0.15.1.

MiniMax-M2 is Mixtral's layout (every layer MoE, `block_sparse_moe.experts.E.w1/w3/w2`) with three
differences, each handled here or by configuration:

- **QK norms over all heads.** `q_norm` and `k_norm` are RMSNorms over the whole projection
  (heads x head dim), not one head; Megatron's `q_layernorm` normalizes each head. Layer:
  `full_qk_norm_attention_class()` is Megatron's SelfAttention whose per-head norms are replaced
  by `q_norm` / `k_norm` over the concatenated heads (at TP > 1 the local heads are gathered
  over the TP group, normalized, and split again), named as slime's MiniMax-M2 spec names them
  (`self_attention.q_norm.weight`), so Megatron checkpoints share names. Their weights are not
  sequence-parallel parameters: each TP rank already holds their whole gradient.
- **Routing.** sigmoid scores, a score-correction bias that steers only the choice, top-k weights
  renormalized: Megatron's sigmoid router with expert bias (`hf_config.load_arch`).
- **Partial RoPE.** `rotary_dim` of each head rotates (halves, not pairs): `rotary_percent`.

Bridge: `minimax_m2_bridge_class()` is mbridge's Mixtral bridge plus the two norms and
`block_sparse_moe.e_score_correction_bias` (the router's expert bias).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tether.train.model.megatron_cpu import quiet_megatron_imports

_CLASSES: dict[str, type] = {}


def full_qk_norm_attention_class() -> type:
    """`FullQKNormSelfAttention`, defined on first use (megatron is imported only on trainer ranks)."""
    if "attention" in _CLASSES:
        return _CLASSES["attention"]
    with quiet_megatron_imports():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import (
            gather_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region,
        )
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import build_module

    class FullQKNormSelfAttention(SelfAttention):  # type: ignore[misc]
        """SelfAttention whose query and key norms span all heads (MiniMax-M2's q_norm/k_norm)."""

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            # Megatron builds per-head norms from these specs; build none, and full ones below.
            norm = submodules.q_layernorm
            super().__init__(
                config,
                dataclasses.replace(submodules, q_layernorm=IdentityOp, k_layernorm=IdentityOp),
                *args,
                **kwargs,
            )
            head_dim = self.hidden_size_per_attention_head
            eps = self.config.layernorm_epsilon
            self.q_norm = build_module(
                norm, hidden_size=head_dim * config.num_attention_heads, config=self.config, eps=eps
            )
            self.k_norm = build_module(
                norm, hidden_size=head_dim * config.num_query_groups, config=self.config, eps=eps
            )
            # Every TP rank computes these norms over all heads and gets their whole gradient (the
            # scatter's backward gathers it): summing it over TP as a sequence-parallel norm's
            # partial gradient would double it.
            for param in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                param.sequence_parallel = False

        def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
            query, key, value, *rest = super().get_query_key_value_tensors(*args, **kwargs)
            query, key = self._full_norm(query, self.q_norm), self._full_norm(key, self.k_norm)
            return (query, key, value, *rest)

        def _full_norm(self, x: Any, norm: Any) -> Any:
            """`norm` over all heads of x [s, b, local heads, head dim] (gathered over TP)."""
            s, b, heads, dim = x.shape
            flat = x.reshape(s, b, heads * dim)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            if tp > 1:
                flat = gather_from_tensor_model_parallel_region(flat)
            flat = norm(flat)
            if tp > 1:
                flat = scatter_to_tensor_model_parallel_region(flat)
            return flat.view(s, b, heads, dim)

    _CLASSES["attention"] = FullQKNormSelfAttention
    return FullQKNormSelfAttention


def with_full_qk_norms(block: Any) -> Any:
    """The block spec `block` with every layer's self-attention a `FullQKNormSelfAttention`."""
    attention = full_qk_norm_attention_class()
    layers = []
    for spec in block.layer_specs:
        self_attention = dataclasses.replace(spec.submodules.self_attention, module=attention)
        submodules = dataclasses.replace(spec.submodules, self_attention=self_attention)
        layers.append(dataclasses.replace(spec, submodules=submodules))
    return dataclasses.replace(block, layer_specs=layers)


def minimax_m2_bridge_class() -> type:
    """mbridge's Mixtral bridge with MiniMax-M2's full QK norms and routing bias (see the module doc)."""
    if "bridge" in _CLASSES:
        return _CLASSES["bridge"]
    with quiet_megatron_imports():
        from mbridge.models.mixtral import MixtralBridge

    layer = "model.layers.{layer_number}."

    class MiniMaxM2Bridge(MixtralBridge):  # type: ignore[misc]
        """MiniMax-M2: Mixtral's names, q_norm/k_norm over all heads, the router's correction bias."""

        _ATTENTION_MAPPING: ClassVar[dict[str, list[str]]] = {
            **MixtralBridge._ATTENTION_MAPPING,
            "self_attention.q_norm.weight": [layer + "self_attn.q_norm.weight"],
            "self_attention.k_norm.weight": [layer + "self_attn.k_norm.weight"],
        }
        _MLP_MAPPING: ClassVar[dict[str, list[str]]] = {
            **MixtralBridge._MLP_MAPPING,
            "mlp.router.expert_bias": [layer + "block_sparse_moe.e_score_correction_bias"],
        }

    _CLASSES["bridge"] = MiniMaxM2Bridge
    return MiniMaxM2Bridge

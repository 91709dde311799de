"""Megatron's local (non-TransformerEngine) layer spec, completed where megatron-core 0.16 falls short
of what TE's spec runs: norms that accept sequence parallelism, and core attention for MLA.

Norms: Megatron's torch norm wrapper (`WrappedTorchNorm`) refuses `sequence_parallel`, so on CPU a model
could not run with --sequence-parallel, which Megatron requires to train MoE layers at TP > 1
(`MoELayer.forward`). A norm needs nothing else for it: under sequence parallelism each TP rank
normalizes its own slice of the sequence, and Megatron's `finalize_model_grads` sums the weight
gradients over the TP group for parameters marked `sequence_parallel` (TE's norms mark theirs the
same way). `SequenceParallelTorchNorm` is torch's RMSNorm/LayerNorm with that mark;
`local_spec` puts it wherever the spec has Megatron's torch norm. With `layernorm_zero_centered_gamma`
(--apply-layernorm-1p; Qwen3-Next) it is `ZeroCenteredRMSNorm`, which scales by 1 + weight as TE's
zero-centred norm does (Megatron's torch norm refuses the setting).

MLA: `MLASelfAttention` builds its core attention with `k_channels`/`v_channels` (its query/key and
value head dims differ), which TE's attention takes and Megatron's local `DotProductAttention` does
not; `MLADotProductAttention` is the local one with those two arguments. And the local spec's
column-parallel `linear_kv_down_proj` gets the gradient of the shared RoPE key (`k_pos_emb`) wrong at
TP > 1: each TP rank's heads add only their share to it, and the all-gather of the projection's
output hands each rank back only its own columns' gradient, unsummed (measured: grad norm at TP=2
differs from TP=1's). TE's spec builds that projection replicated ("duplicated"); so does this one,
with Megatron's replicated `Linear`: then MLA gathers `k_pos_emb` over the sequence-parallel region,
whose backward sums the heads' shares, and the weight's gradient is summed over TP as a
sequence-parallel parameter. (MoE layers at TP > 1 train only with sequence parallelism anyway.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that scales by 1 + weight (the weight stored zero-centred, initialized to 0): Megatron's
    `layernorm_zero_centered_gamma` (--apply-layernorm-1p), which only TransformerEngine's norm
    implements in megatron-core 0.16; as transformers' Qwen3-Next RMSNorm, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class SequenceParallelTorchNorm:
    """torch.nn.RMSNorm / LayerNorm built from a Megatron config, its weights marked for sequence
    parallelism when the config has it on (the signature of Megatron's norm modules)."""

    def __new__(  # type: ignore[misc]
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.memory_efficient_layer_norm:
            raise ValueError("memory-efficient layer norm needs TransformerEngine")
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            raise ValueError("zero-centered gamma (--apply-layernorm-1p) is built for RMSNorm only")
        norm: torch.nn.Module
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: only RMSNorm and LayerNorm")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def _replace(node: Any, old: type, new: type) -> Any:
    """`node` (a spec, a submodules dataclass, or a module class) with `old` replaced by `new`."""
    if node is old:
        return new
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, list):
                replaced: Any = [_replace(v, old, new) for v in value]
            else:
                replaced = _replace(value, old, new)
            if replaced is not value:
                changes[f.name] = replaced
        return dataclasses.replace(node, **changes) if changes else node
    return node


def local_spec(spec: Any, multi_latent_attention: bool, *, context_parallel: bool = False) -> Any:
    """The local spec `spec` with Megatron's torch norm swapped for `SequenceParallelTorchNorm`,
    with MLA its core attention for `MLADotProductAttention`, and under context parallelism the
    core attention for its CP form (`tether.train.parallel.context`)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = _replace(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    attention: type = DotProductAttention
    if multi_latent_attention:
        attention = _mla_attention_class()
        spec = _replace(spec, DotProductAttention, attention)
        spec = _replicated_kv_down_proj(spec)
    if context_parallel:
        from tether.train.parallel.context import context_parallel_attention

        spec = _replace(spec, attention, context_parallel_attention(attention))
    return spec


def mla_core_attention(*, context_parallel: bool) -> type:
    """MLA's local core attention (`MLADotProductAttention`), in its CP form under context parallelism."""
    attention = _mla_attention_class()
    if context_parallel:
        from tether.train.parallel.context import context_parallel_attention

        cp_attention: type = context_parallel_attention(attention)
        return cp_attention
    return attention


def _replicated_kv_down_proj(node: Any) -> Any:
    """`node` with every MLA attention's linear_kv_down_proj built replicated (see the module doc)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    if isinstance(node, MLASelfAttentionSubmodules):
        return dataclasses.replace(node, linear_kv_down_proj=Linear)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            replaced = (
                [_replicated_kv_down_proj(v) for v in value]
                if isinstance(value, list)
                else _replicated_kv_down_proj(value)
            )
            if replaced is not value:
                changes[f.name] = replaced
        return dataclasses.replace(node, **changes) if changes else node
    return node


_MLA_ATTENTION: list[type] = []


def _mla_attention_class() -> type:
    """`MLADotProductAttention`, defined on first use (megatron is imported only on trainer ranks)."""
    if _MLA_ATTENTION:
        return _MLA_ATTENTION[0]
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """Megatron's local attention with separate query/key (`k_channels`) and value (`v_channels`)
        head dims: the scores use the given softmax scale, the output has heads x v_channels."""

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            k_channels: int | None = None,
            v_channels: int | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
        ) -> None:
            super().__init__(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            del k_channels  # the scores need only the scale, which MLA passes
            if v_channels is not None:
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    _MLA_ATTENTION.append(MLADotProductAttention)
    return MLADotProductAttention

"""Qwen3-Next (HF model_type `qwen3_next`) in megatron-core 0.16 through mbridge 0.15.1.

Qwen3-Next's decoder mixes two token mixers (`layer_types`; by default a full-attention layer every
`full_attention_interval` layers, linear attention in the others) over Qwen2-MoE's experts (softmax
router, a shared expert with a sigmoid gate). Each piece is Megatron's, configured from the HF config
(`hf_config.load_arch`, `bridge._restored_facts`):

- **Linear attention.** transformers' `Qwen3NextGatedDeltaNet` is Megatron's `GatedDeltaNet`
  (megatron/core/ssm/gated_delta_net.py; `experimental_attention_variant="gated_delta_net"` with
  `linear_attention_freq` as the per-layer pattern): one input projection to q, k, v, the output
  gate z, beta and alpha; a depthwise causal convolution with SiLU over q, k, v; L2-normalized q and
  k; the chunked gated delta rule; a gated RMSNorm per value head; the output projection. Megatron
  builds it only with flash-linear-attention (`fla`) installed; without it `torch_gated_delta_rule`
  gives the module Megatron's own pure-torch chunked rule (its deterministic path) and an L2 norm
  written here with fla's formula. `with_gated_delta_net` puts it in the layers of either spec (the
  layer keeps an input norm of its own under both).
- **Gated full attention.** `q_proj` yields each head's query and its output gate ([q_h; gate_h] per
  head): Megatron's `attention_output_gate`, whose `linear_qkv` holds, per query group, the group's
  queries, then their gates, then its key and value (`Qwen3NextBridge`).
- **Norms.** Qwen3-Next's RMSNorms scale by 1 + weight (the weight is stored zero-centred), as
  Megatron's `layernorm_zero_centered_gamma` (--apply-layernorm-1p); the local spec's norm does it
  (`spec.ZeroCenteredRMSNorm`): input, pre-MLP, final and per-head q/k norms. The gated norm inside
  linear attention scales by its weight as it is (transformers' Qwen3NextRMSNormGated, slime's
  FusedRMSNormGated): `GatedDeltaNetOutputNorm`.
- **Partial RoPE**: `rotary_percent` (partial_rotary_factor), halves rotated as Megatron does.

Bridge: mbridge's Qwen2-MoE bridge plus the gated `q_proj` and linear attention's tensors. HF groups
`in_proj_qkvz` and `in_proj_ba` per key head ([q_h, k_h, v_h*, z_h*] and [b_h*, a_h*], * the value
heads of key head h); Megatron's `in_proj` is, per TP rank, [q, k, v, z, b, a] of the rank's heads.
The full (TP-free) Megatron tensor here is the TP=1 layout; TP splits and merges cut each part.

Megatron checkpoint names of the linear-attention layers are Megatron's GatedDeltaNet's
(`self_attention.in_proj.weight`, ...); slime's spec wraps transformers' module
(`self_attention.linear_attn.*`), whose checkpoints `tether.train.checkpoint.hf_wrapped_layers`
converts on load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.parallel import context

_CLASSES: dict[str, type] = {}

# Linear attention's parameters (names under self_attention) that are split over TP by parts.
IN_PROJ = "self_attention.in_proj.weight"
CONV = "self_attention.conv1d.weight"


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit L2 norm over `dim` (fla's l2norm: x / sqrt(sum x^2 + eps))."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def torch_gated_delta_rule() -> None:
    """Patch (megatron/core/ssm/gated_delta_net.py, HAVE_FLA/chunk_gated_delta_rule/l2norm): without
    flash-linear-attention Megatron refuses to build GatedDeltaNet; give the module Megatron's own
    pure-torch chunked rule (`torch_chunk_gated_delta_rule`, what its deterministic mode runs) and
    `l2norm`. Nothing changes there where fla is installed. Then every sequence-mixing function the
    module calls runs over the whole sequence under context parallelism (`over_context`)."""
    with quiet_megatron_imports():
        from megatron.core.ssm import gated_delta_net

    module: Any = gated_delta_net
    if getattr(module, "_tether_patched", False):
        return
    if not module.HAVE_FLA:
        rule = module.torch_chunk_gated_delta_rule

        def chunk_gated_delta_rule(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
            kwargs.pop("cu_seqlens", None)  # varlen is refused before (packed sequences)
            return rule(query, key, value, **kwargs)

        module.chunk_gated_delta_rule = chunk_gated_delta_rule
        module.l2norm = l2norm
        module.HAVE_FLA = True
    module.chunk_gated_delta_rule = over_context(module.chunk_gated_delta_rule)
    module.torch_chunk_gated_delta_rule = over_context(module.torch_chunk_gated_delta_rule)
    if module.causal_conv1d_fn is not None:  # the CUDA kernel Megatron calls instead of its conv1d
        module.causal_conv1d_fn = convolution_over_context(module.causal_conv1d_fn)
    module._tether_patched = True


def select_gdn_backend(backend: str) -> None:
    """--qwen-gdn-backend (slime's flag): the chunked gated delta rule GatedDeltaNet calls. `fla` is
    what `torch_gated_delta_rule` leaves (fla's kernel, else Megatron's pure-torch rule); `flashqla`
    FlashQLA's kernel, which takes contiguous inputs (the rank's capabilities were checked before)."""
    torch_gated_delta_rule()
    if backend == "fla":
        return
    from flash_qla import chunk_gated_delta_rule as flashqla_rule  # type: ignore[import-not-found]

    with quiet_megatron_imports():
        from megatron.core.ssm import gated_delta_net

    def rule(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
        for name in ("g", "beta"):
            kwargs[name] = kwargs[name].contiguous()
        return flashqla_rule(query.contiguous(), key.contiguous(), value.contiguous(), **kwargs)

    module: Any = gated_delta_net
    module.chunk_gated_delta_rule = over_context(rule)


# Context parallelism: megatron-core 0.16 asserts CP == 1 for GatedDeltaNet. Its only operations that
# mix positions are the causal convolution and the delta rule; each runs here over the whole sequence
# (every CP rank's share gathered in position order) and keeps this rank's positions of the result.
# The gather's backward sums every rank's gradient for this rank's positions (`context.gather_sequence`),
# as each rank's loss reaches the others' positions through the recurrence; slime instead keeps only
# the local gradient, which drops what later positions on other ranks owe to this rank's.


def over_context(rule: Any) -> Any:
    """A gated delta rule (q, k, v, g, beta: [b, s, heads, ...], sequence on dim 1) under context
    parallelism: run over the gathered sequence, this rank's positions of the output returned."""

    def run(query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
        layout = context.current()
        if layout.size == 1:
            return rule(query, key, value, **kwargs)
        gathered = [context.gather_sequence(t, 1, layout) for t in (query, key, value)]
        for name in ("g", "beta"):
            kwargs[name] = context.gather_sequence(kwargs[name], 1, layout)
        out, state = rule(*gathered, **kwargs)
        return context.slice_sequence(out, layout), state

    return run


def convolution_over_context(conv: Any) -> Any:
    """A causal convolution function (x [b, channels, s]) under context parallelism, likewise."""

    def run(*, x: Any, **kwargs: Any) -> Any:
        layout = context.current()
        if layout.size == 1:
            return conv(x=x, **kwargs)
        full = conv(x=context.gather_sequence(x, 2, layout), **kwargs)
        return full.index_select(2, layout.positions(full.shape[2], full.device))

    return run


class ContextParallelConv1d(torch.nn.Conv1d):
    """GatedDeltaNet's depthwise causal convolution under context parallelism (see above): over the
    gathered sequence, this rank's positions of the output (Megatron then trims to this rank's
    length, which they already are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = context.current()
        if layout.size == 1:
            return super().forward(x)
        full = context.gather_sequence(x, 2, layout)
        out = super().forward(full)[..., : full.shape[2]]
        return out.index_select(2, layout.positions(full.shape[2], out.device))


class GatedDeltaNetOutputNorm:
    """The per-value-head RMSNorm inside linear attention (then gated by SiLU(z) by Megatron): it
    scales by its weight as stored, whatever `layernorm_zero_centered_gamma` says (transformers'
    Qwen3NextRMSNormGated). Each TP rank holds its own heads: under sequence parallelism the weight's
    gradient is summed over TP like the other norms'; Qwen3-Next is MoE, which Megatron trains at
    TP > 1 only with sequence parallelism."""

    def __new__(  # type: ignore[misc]
        cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def linear_attention_spec(transformer_engine: bool) -> Any:
    """ModuleSpec of Megatron's GatedDeltaNet: TE's column/row-parallel linears under TE's spec,
    Megatron's local ones otherwise; the output norm is `GatedDeltaNetOutputNorm` under both (it
    scales by its weight as stored, which TE's norm would read as zero-centred)."""
    torch_gated_delta_rule()
    with quiet_megatron_imports():
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import ModuleSpec

    column: Any = ColumnParallelLinear
    row: Any = RowParallelLinear
    if transformer_engine:
        with quiet_megatron_imports():
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelLinear,
                TERowParallelLinear,
            )
        column, row = TEColumnParallelLinear, TERowParallelLinear
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=column, out_norm=GatedDeltaNetOutputNorm, out_proj=row),
    )


def with_gated_delta_net(block: Any, config: Any, transformer_engine: bool, pp_rank: int) -> Any:
    """The block spec `block` (this stage's layers) with the linear-attention layers' self-attention
    Megatron's GatedDeltaNet (`config.linear_attention_freq`: 1 for linear attention, per layer).

    Under TE's spec the layer's input norm is fused into attention's linear_qkv (the layer holds an
    IdentityOp); a linear-attention layer gets TE's norm of its own instead (zero-centred as
    --apply-layernorm-1p says), so its parameters keep the local spec's names
    (`input_layernorm.weight`, `self_attention.in_proj.weight`, ...) and one bridge and one
    checkpoint layout serve both specs. Megatron's own TE spec fuses that norm into `in_proj`."""
    with quiet_megatron_imports():
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = list(config.linear_attention_freq)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    linear = linear_attention_spec(transformer_engine) if 1 in pattern else None
    replace: dict[str, Any] = {"self_attention": linear}
    if transformer_engine:
        with quiet_megatron_imports():
            from megatron.core.extensions.transformer_engine import TENorm
        replace["input_layernorm"] = TENorm
    layers = []
    for i, spec in enumerate(block.layer_specs):
        if pattern[offset + i]:
            submodules = dataclasses.replace(spec.submodules, **replace)
            spec = dataclasses.replace(spec, submodules=submodules)
        layers.append(spec)
    return dataclasses.replace(block, layer_specs=layers)


def mark_gated_delta_net_params(model: Any) -> int:
    """GatedDeltaNet marks its conv1d, dt_bias and A_log `tensor_model_parallel` without a partition
    dim (Megatron's initializers set it for its own linears); give them dim 0, which their TP split
    is (tether reads it where it gathers TP shards). Returns how many were marked."""
    with quiet_megatron_imports():
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    marked = 0
    for module in model.modules():
        if not isinstance(module, GatedDeltaNet):
            continue
        # Same parameters and names; its forward runs over the whole sequence under CP (see above).
        module.conv1d.__class__ = ContextParallelConv1d
        for param in (module.conv1d.weight, module.dt_bias, module.A_log):
            if getattr(param, "tensor_model_parallel", False) and not hasattr(param, "partition_dim"):
                param.partition_dim = 0  # type: ignore[attr-defined]
                param.partition_stride = 1  # type: ignore[attr-defined]
                marked += 1
    return marked


@dataclasses.dataclass(frozen=True)
class LinearAttentionShape:
    """Linear attention's head counts and dims (HF linear_* fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, hf: Any) -> LinearAttentionShape:
        return cls(
            key_heads=int(hf.linear_num_key_heads),
            value_heads=int(hf.linear_num_value_heads),
            key_dim=int(hf.linear_key_head_dim),
            value_dim=int(hf.linear_value_head_dim),
        )

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads

    def in_proj_parts(self) -> list[int]:
        """Rows of q, k, v, z, b, a in Megatron's in_proj (all heads)."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return [qk, qk, v, v, self.value_heads, self.value_heads]

    def conv_parts(self) -> list[int]:
        """Channels of q, k, v in the convolution (all heads)."""
        return self.in_proj_parts()[:3]


def split_parts(full: torch.Tensor, parts: list[int], tp: int) -> list[torch.Tensor]:
    """Each TP rank's rows of `full` (its `parts` stacked): the rank's share of every part, in order."""
    chunks = [p.chunk(tp) for p in full.split(parts)]
    return [torch.cat([c[r] for c in chunks]) for r in range(tp)]


def merge_parts(shards: list[torch.Tensor], parts: list[int]) -> torch.Tensor:
    """The inverse of `split_parts`: per part, the TP ranks' shares in rank order."""
    tp = len(shards)
    local = [p // tp for p in parts]
    per_rank = [s.split(local) for s in shards]
    return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(parts))])


def in_proj_to_mcore(qkvz: torch.Tensor, ba: torch.Tensor, shape: LinearAttentionShape) -> torch.Tensor:
    """HF in_proj_qkvz / in_proj_ba (grouped per key head) → Megatron's in_proj [q; k; v; z; b; a]."""
    h, r = shape.key_heads, shape.ratio
    rest = qkvz.shape[1:]
    grouped = qkvz.reshape(h, -1, *rest)
    q, k, v, z = grouped.split(
        [shape.key_dim, shape.key_dim, r * shape.value_dim, r * shape.value_dim], dim=1
    )
    b, a = ba.reshape(h, 2 * r, *rest).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)]).contiguous()


def in_proj_to_hf(in_proj: torch.Tensor, shape: LinearAttentionShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's in_proj → HF (in_proj_qkvz, in_proj_ba)."""
    h = shape.key_heads
    rest = in_proj.shape[1:]
    q, k, v, z, b, a = (t.reshape(h, -1, *rest) for t in in_proj.split(shape.in_proj_parts()))
    qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, *rest).contiguous()
    ba = torch.cat([b, a], dim=1).reshape(-1, *rest).contiguous()
    return qkvz, ba


def gated_qkv_to_mcore(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int
) -> torch.Tensor:
    """HF q_proj ([q_h; gate_h] per head), k_proj, v_proj → Megatron's gated linear_qkv: per query
    group its queries, their gates, its key, its value."""
    rest = q.shape[1:]
    per_head = q.reshape(groups, -1, 2, head_dim, *rest)
    query = per_head[:, :, 0].reshape(groups, -1, *rest)
    gate = per_head[:, :, 1].reshape(groups, -1, *rest)
    key, value = k.reshape(groups, head_dim, *rest), v.reshape(groups, head_dim, *rest)
    return torch.cat([query, gate, key, value], dim=1).reshape(-1, *rest).contiguous()


def gated_qkv_to_hf(
    qkv: torch.Tensor, groups: int, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's gated linear_qkv → HF (q_proj, k_proj, v_proj)."""
    rest = qkv.shape[1:]
    per_group = heads // groups * head_dim
    query, gate, key, value = qkv.reshape(groups, -1, *rest).split(
        [per_group, per_group, head_dim, head_dim], dim=1
    )
    shaped = (groups, heads // groups, 1, head_dim, *rest)
    q = torch.cat([query.reshape(shaped), gate.reshape(shaped)], dim=2).reshape(-1, *rest).contiguous()
    return q, key.reshape(-1, *rest).contiguous(), value.reshape(-1, *rest).contiguous()


def qwen3_next_bridge_class() -> type:
    """mbridge's Qwen2-MoE bridge with Qwen3-Next's gated q_proj and linear attention (module doc)."""
    if "bridge" in _CLASSES:
        return _CLASSES["bridge"]
    with quiet_megatron_imports():
        from mbridge.models.qwen2moe import Qwen2MoEBridge

    layer = "model.layers.{layer_number}."
    linear = layer + "linear_attn."

    class Qwen3NextBridge(Qwen2MoEBridge):  # type: ignore[misc]
        """Qwen3-Next: Qwen2-MoE's names, gated q_proj, linear attention (GatedDeltaNet)."""

        _ATTENTION_MAPPING: ClassVar[dict[str, list[str]]] = {
            **Qwen2MoEBridge._ATTENTION_MAPPING,
            IN_PROJ: [linear + "in_proj_qkvz.weight", linear + "in_proj_ba.weight"],
            CONV: [linear + "conv1d.weight"],
            "self_attention.dt_bias": [linear + "dt_bias"],
            "self_attention.A_log": [linear + "A_log"],
            "self_attention.out_norm.weight": [linear + "norm.weight"],
            "self_attention.out_proj.weight": [linear + "out_proj.weight"],
        }
        # Qwen2-MoE's names plus a dense layer's MLP (mlp_only_layers); mbridge picks the first key
        # contained in the Megatron name, and none of these is inside an expert's name.
        _MLP_MAPPING: ClassVar[dict[str, list[str]]] = {
            **Qwen2MoEBridge._MLP_MAPPING,
            "mlp.linear_fc1.layer_norm_weight": [layer + "post_attention_layernorm.weight"],
            "mlp.linear_fc1.weight": [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"],
            "mlp.linear_fc2.weight": [layer + "mlp.down_proj.weight"],
        }

        def _shape(self) -> LinearAttentionShape:
            return LinearAttentionShape.of(self.hf_config)

        def _attention_dims(self) -> tuple[int, int, int]:
            hf = self.hf_config
            heads = int(hf.num_attention_heads)
            head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
            return int(hf.num_key_value_heads), heads, head_dim

        def _weight_to_mcore_format(self, name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
            if name.endswith(IN_PROJ):
                qkvz, ba = (w.to(self.dtype) for w in hf_weights)
                return in_proj_to_mcore(qkvz, ba, self._shape())
            if name.endswith("self_attention.linear_qkv.weight"):
                groups, _heads, head_dim = self._attention_dims()
                q, k, v = (w.to(self.dtype) for w in hf_weights)
                return gated_qkv_to_mcore(q, k, v, groups, head_dim)
            return super()._weight_to_mcore_format(name, hf_weights)

        def _weight_to_hf_format(
            self, name: str, weights: torch.Tensor
        ) -> tuple[list[str], list[torch.Tensor]]:
            if name.endswith(IN_PROJ):
                return self._weight_name_mapping_mcore_to_hf(name), list(
                    in_proj_to_hf(weights, self._shape())
                )
            if name.endswith("self_attention.linear_qkv.weight"):
                groups, heads, head_dim = self._attention_dims()
                return self._weight_name_mapping_mcore_to_hf(name), list(
                    gated_qkv_to_hf(weights, groups, heads, head_dim)
                )
            return super()._weight_to_hf_format(name, weights)

        def _weight_split_across_tp(
            self, name: str, weights: torch.Tensor, param: torch.Tensor, tp_split_size: int
        ) -> list[torch.Tensor]:
            if tp_split_size > 1 and name.endswith(IN_PROJ):
                return split_parts(weights, self._shape().in_proj_parts(), tp_split_size)
            if tp_split_size > 1 and name.endswith(CONV):
                return split_parts(weights, self._shape().conv_parts(), tp_split_size)
            return super()._weight_split_across_tp(name, weights, param, tp_split_size)

        def _weight_merge_across_tp(
            self, name: str, weights: list[torch.Tensor], param: torch.Tensor
        ) -> torch.Tensor:
            if len(weights) > 1 and name.endswith(IN_PROJ):
                return merge_parts(weights, self._shape().in_proj_parts())
            if len(weights) > 1 and name.endswith(CONV):
                return merge_parts(weights, self._shape().conv_parts())
            return super()._weight_merge_across_tp(name, weights, param)

    _CLASSES["bridge"] = Qwen3NextBridge
    return Qwen3NextBridge

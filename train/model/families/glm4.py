"""GLM-4 dense (HF model_type `glm4`, e.g. GLM-4-9B-0414) in megatron-core 0.16 through mbridge 0.15.1.

Glm4DecoderLayer normalizes each sublayer's output again before the residual add ("sandwich" norms):

    h = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

megatron-core's `TransformerLayer` has no norm after attention or the MLP, and mbridge has no glm4
bridge. Here:

- Layer: `post_norm_layer_class()` is Megatron's TransformerLayer with the two norms, as modules named
  like slime's Megatron (`decoder.layers.N.post_self_attn_layernorm.weight`, `...post_mlp_layernorm...`),
  so checkpoints share names. They are applied to the sublayer's output inside the layer's
  bias-dropout-add, so Megatron's own forward (recompute, offloading, sequence parallelism) runs
  unchanged around them. `with_post_sublayer_norms` puts the layer in a block spec with the block's
  final-norm class for the two norms: TENorm under TransformerEngine's spec, Megatron's torch norm
  (then `spec.SequenceParallelTorchNorm`) under the local one.
- Bridge: `glm4_bridge_class()` is mbridge's Qwen2 bridge (q/k/v biases, tied-embedding handling) with
  GLM-4's names: the fused `mlp.gate_up_proj` is Megatron's fused fc1 as it is ([gate; up] rows; mbridge
  splits and merges gate and up per TP rank for any `linear_fc1.weight`), plus the two norms.

RoPE needs no code: Glm4's rotary embedding is Megatron's with `rotary_interleaved` and `rotary_percent`
(`hf_config.load_arch` reads both).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from tether.train.model.megatron_cpu import quiet_megatron_imports

_CLASSES: dict[str, type] = {}


def _normed(output_with_bias: tuple[Any, Any], norm: Any) -> tuple[Any, None]:
    """The sublayer's (output, bias) normalized as one tensor (GLM's projections have no bias)."""
    output, bias = output_with_bias
    if bias is not None:
        output = output + bias
    return norm(output), None


def post_norm_layer_class() -> type:
    """`PostNormTransformerLayer`, defined on first use (megatron is imported only on trainer ranks)."""
    if "layer" in _CLASSES:
        return _CLASSES["layer"]
    with quiet_megatron_imports():
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module
        from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    @dataclasses.dataclass
    class PostNormLayerSubmodules(TransformerLayerSubmodules):
        """TransformerLayerSubmodules with the norms of attention's and the MLP's outputs."""

        post_self_attn_layernorm: ModuleSpec | type = IdentityOp
        post_mlp_layernorm: ModuleSpec | type = IdentityOp

    class PostNormTransformerLayer(TransformerLayer):
        """Megatron's TransformerLayer whose attention and MLP outputs are normalized before the
        residual add (GLM-4's post_self_attn_layernorm / post_mlp_layernorm)."""

        # Megatron's bias-dropout-add factories (set by TransformerLayer.__init__, wrapped below).
        self_attn_bda: Any
        mlp_bda: Any

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, submodules, *args, **kwargs)
            if config.inference_fuse_tp_communication:
                # That inference path adds the residual inside the projections, past the norms.
                raise ValueError("post-sublayer norms do not run with inference_fuse_tp_communication")
            norm_args = {
                "config": self.config,
                "hidden_size": self.config.hidden_size,
                "eps": self.config.layernorm_epsilon,
            }
            self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_args)
            self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_args)
            # TransformerLayer calls `self.*_bda(training, fused)(output_with_bias, residual, p)`;
            # bound methods (not closures) so a deep copy of the layer uses its own norms.
            self._megatron_self_attn_bda = self.self_attn_bda
            self._megatron_mlp_bda = self.mlp_bda
            self.self_attn_bda = self._post_self_attn_bda
            self.mlp_bda = self._post_mlp_bda

        def _post_self_attn_bda(self, training: bool, fused: bool) -> Any:
            bda = self._megatron_self_attn_bda(training, fused)
            norm = self.post_self_attn_layernorm
            return lambda output_with_bias, residual, prob: bda(
                _normed(output_with_bias, norm), residual, prob
            )

        def _post_mlp_bda(self, training: bool, fused: bool) -> Any:
            bda = self._megatron_mlp_bda(training, fused)
            norm = self.post_mlp_layernorm
            return lambda output_with_bias, residual, prob: bda(
                _normed(output_with_bias, norm), residual, prob
            )

    _CLASSES["layer"] = PostNormTransformerLayer
    _CLASSES["submodules"] = PostNormLayerSubmodules
    return PostNormTransformerLayer


def with_post_sublayer_norms(block: Any) -> Any:
    """The block spec `block` (TransformerBlockSubmodules) with every layer a `PostNormTransformerLayer`
    whose two output norms are the block's final-norm class."""
    with quiet_megatron_imports():
        from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    layer_cls = post_norm_layer_class()
    submodules_cls = _CLASSES["submodules"]
    norm = block.layer_norm
    layers = []
    for spec in block.layer_specs:
        if spec.module is not TransformerLayer:
            # MoE layers (MoETransformerLayer) have no post-sublayer norms in any family tether builds.
            raise ValueError(f"post-sublayer norms need Megatron's TransformerLayer, not {spec.module}")
        fields = {
            f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(TransformerLayerSubmodules)
        }
        submodules = submodules_cls(**fields, post_self_attn_layernorm=norm, post_mlp_layernorm=norm)
        layers.append(dataclasses.replace(spec, module=layer_cls, submodules=submodules))
    return dataclasses.replace(block, layer_specs=layers)


def glm4_bridge_class() -> type:
    """mbridge's Qwen2 bridge with GLM-4 dense's weight names (see the module doc)."""
    if "bridge" in _CLASSES:
        return _CLASSES["bridge"]
    with quiet_megatron_imports():
        from mbridge.models.qwen2 import Qwen2Bridge

    layer = "model.layers.{layer_number}."

    class Glm4Bridge(Qwen2Bridge):  # type: ignore[misc]
        """GLM-4 dense: Qwen2's attention names, fused gate_up_proj, the two sandwich norms."""

        # mbridge picks the first key contained in the Megatron name: fc1's norm before fc1.
        _MLP_MAPPING: ClassVar[dict[str, list[str]]] = {
            "mlp.linear_fc1.layer_norm_weight": [layer + "post_attention_layernorm.weight"],
            "mlp.linear_fc1.weight": [layer + "mlp.gate_up_proj.weight"],
            "mlp.linear_fc2.weight": [layer + "mlp.down_proj.weight"],
            "post_mlp_layernorm.weight": [layer + "post_mlp_layernorm.weight"],
        }
        # Names with neither ".self_attention." nor "mlp" are looked up here.
        _OTHER_MAPPING: ClassVar[dict[str, list[str]]] = {
            "post_self_attn_layernorm.weight": [layer + "post_self_attn_layernorm.weight"]
        }

    _CLASSES["bridge"] = Glm4Bridge
    return Glm4Bridge

"""Qwen3.5 (HF model_type `qwen3_5`, dense, and `qwen3_5_moe`) in megatron-core 0.16 through mbridge.

Qwen3.5's decoder is Qwen3-Next's (`qwen3_next`: Megatron's GatedDeltaNet for the linear-attention
layers, gated full attention, zero-centred norms, partial RoPE), built the same way; what differs is
in the checkpoint:

- **Linear attention's projections apart.** transformers' Qwen3_5GatedDeltaNet holds `in_proj_qkv`
  (all query heads, then all key heads, then all value heads), `in_proj_z`, `in_proj_b` and
  `in_proj_a` — together exactly Megatron's `in_proj` rows [q; k; v; z; b; a] (slime's
  Qwen3_5GatedDeltaNet splits them the same way), where Qwen3-Next groups them per key head.
- **Published as a vision-language model.** config.json nests the decoder under `text_config` and the
  tensors sit under `model.language_model.` beside the vision tower (`model.visual.*`) and the MTP
  module (`mtp.*`); `hf_config.language_model_config` reads it, the HF names here carry the prefix,
  and `hf_convert.in_base_form` writes the untouched tensors back. A text-only checkpoint
  (qwen3_5_text) keeps the decoder under `model.`.
- **Dense or MoE.** `qwen3_5` has a dense MLP in every layer; `qwen3_5_moe` Qwen3-Next's experts
  with a gated shared expert, stored fused as transformers does (`hf_convert.HFWeights` reads an
  expert's slice of `experts.gate_up_proj` / `experts.down_proj`).

slime trains Qwen3.5 through its spec `slime_plugins.models.qwen3_5` (transformers' module wrapped
as `self_attention.linear_attn.*`); tether's Megatron names are Megatron's GatedDeltaNet's, and
slime's Megatron checkpoints are converted on load (`tether.train.checkpoint.hf_wrapped_layers`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tether.train.model.families.qwen3_next import IN_PROJ, LinearAttentionShape, qwen3_next_bridge_class

_CLASSES: dict[tuple[str, bool], type] = {}


def in_proj_parts_hf(shape: LinearAttentionShape) -> list[int]:
    """Rows of in_proj_qkv, in_proj_z, in_proj_b and in_proj_a."""
    q, k, v, z, b, a = shape.in_proj_parts()
    return [q + k + v, z, b, a]


def in_proj_to_mcore(hf: list[torch.Tensor]) -> torch.Tensor:
    """Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a → Megatron's in_proj [q; k; v; z; b; a]."""
    return torch.cat(hf).contiguous()


def in_proj_to_hf(in_proj: torch.Tensor, shape: LinearAttentionShape) -> list[torch.Tensor]:
    """Megatron's in_proj → Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    return [t.contiguous() for t in in_proj.split(in_proj_parts_hf(shape))]


def _prefixed(names: list[str], prefix: str) -> list[str]:
    """mbridge's `model.`-rooted names under the checkpoint's prefix (lm_head stays where it is)."""
    return [prefix + n.removeprefix("model.") if n.startswith("model.") else n for n in names]


def qwen3_5_bridge_class(prefix: str, moe: bool) -> type:
    """Qwen3-Next's bridge with Qwen3.5's names: the decoder under `prefix`, linear attention's four
    input projections, and (dense) no MoE fields in the config mbridge builds."""
    key = (prefix, moe)
    if key in _CLASSES:
        return _CLASSES[key]
    base: Any = qwen3_next_bridge_class()
    linear = "model.layers.{layer_number}.linear_attn."

    class Qwen3_5Bridge(base):  # type: ignore[misc, valid-type]
        """Qwen3.5: Qwen3-Next's layers under Qwen3.5's checkpoint names (module doc)."""

        _ATTENTION_MAPPING: ClassVar[dict[str, list[str]]] = {
            **base._ATTENTION_MAPPING,
            IN_PROJ: [
                linear + "in_proj_qkv.weight",
                linear + "in_proj_z.weight",
                linear + "in_proj_b.weight",
                linear + "in_proj_a.weight",
            ],
        }

        def _build_config(self) -> Any:
            if moe:
                return super()._build_config()
            # A dense Qwen3.5 config has no MoE fields; tether's restored facts set the rest.
            return self._build_base_config(use_cpu_initialization=False)

        def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
            return _prefixed(super()._weight_name_mapping_mcore_to_hf(name), prefix)

        def _weight_to_mcore_format(self, name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
            if name.endswith(IN_PROJ):
                return in_proj_to_mcore([w.to(self.dtype) for w in hf_weights])
            return super()._weight_to_mcore_format(name, hf_weights)

        def _weight_to_hf_format(
            self, name: str, weights: torch.Tensor
        ) -> tuple[list[str], list[torch.Tensor]]:
            if name.endswith(IN_PROJ):
                return self._weight_name_mapping_mcore_to_hf(name), in_proj_to_hf(weights, self._shape())
            return super()._weight_to_hf_format(name, weights)

    _CLASSES[key] = Qwen3_5Bridge
    return Qwen3_5Bridge

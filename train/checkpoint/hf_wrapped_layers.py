"""Megatron checkpoints of layers slime builds around transformers' modules: Qwen3-Next's and
Qwen3.5's linear attention (slime_plugins.models.qwen3_next / qwen3_5).

slime's spec puts transformers' gated DeltaNet and its input norm inside the attention module, so a
Megatron checkpoint slime (or its HF -> torch_dist converter) writes holds them as whole, replicated
HF tensors:

    decoder.layers.{i}.self_attention.linear_attn.<HF name>     (in_proj_qkvz, conv1d.weight, A_log, ...)
    decoder.layers.{i}.self_attention.input_layernorm.weight

tether builds Megatron's GatedDeltaNet there (`families.qwen3_next`), whose tensors are named and laid
out otherwise (`self_attention.in_proj.weight` [q; k; v; z; b; a] split over TP, the layer's own
input norm). A load from such a checkpoint asks for slime's tensors instead of those and converts
them through the model's bridge, exactly as from the HF checkpoint; everything else loads as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.train.model import bridge
from tether.train.model.megatron_cpu import quiet_megatron_imports

SLIME_LINEAR = ".self_attention.linear_attn."
SLIME_NORM = ".self_attention.input_layernorm.weight"
_KEY = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.(linear_attn\.(.+)|input_layernorm\.weight)$")
# Our linear-attention layer's tensors (its GatedDeltaNet and the layer's input norm), local names.
_OURS = re.compile(
    r"^decoder\.layers\.(\d+)\.(input_layernorm\.weight|self_attention\.(?!linear_qkv|linear_proj)[^.]+.*)$"
)


def holds_wrapped_layers(available: set[str]) -> bool:
    """Whether a checkpoint's tensors are slime's wrapped linear-attention layers."""
    return any(SLIME_LINEAR in key for key in available)


@dataclass
class WrappedLoad:
    """One chunk's part of such a load: the requests for slime's tensors (checkpoint key ->
    ShardedTensor) and the local names they replace."""

    requests: dict[str, Any] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)


def _linear_layers(chunk: Any) -> Iterator[tuple[int, int]]:
    """(local index, global index) of each linear-attention layer of this chunk."""
    with quiet_megatron_imports():
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for local, layer in enumerate(bridge.unwrap(chunk).decoder.layers):
        if isinstance(layer.self_attention, GatedDeltaNet):
            yield local, int(layer.layer_number) - 1


def plan(chunk: Any, model_sharded: dict[str, Any], metadata: dict[str, Any]) -> WrappedLoad:
    """Take this chunk's linear-attention tensors out of its load request `model_sharded` (in place)
    and ask for slime's tensors of the same layers (`metadata`: the checkpoint's tensors)."""
    with quiet_megatron_imports():
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layers = dict(_linear_layers(chunk))
    load = WrappedLoad()
    for name in list(model_sharded):
        m = _OURS.match(name)
        if m is not None and int(m.group(1)) in layers:
            del model_sharded[name]
            if not name.endswith("_extra_state"):
                load.replaced.add(name)
    wanted = set(layers.values())
    for key, meta in metadata.items():
        m = _KEY.match(key)
        if m is None or int(m.group(1)) not in wanted:
            continue
        data = torch.empty(tuple(meta.global_shape), dtype=meta.dtype)
        # Whole on every rank: one main replica (rank 0), as dist_checkpointing's checks require.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        load.requests[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=rank)
    missing = wanted - {int(m.group(1)) for k in load.requests if (m := _KEY.match(k))}
    if missing:
        raise KeyError(f"the checkpoint holds no linear-attention tensors of layers {sorted(missing)}")
    return load


def hf_tensors(loaded: dict[str, torch.Tensor], arch: Any) -> dict[str, torch.Tensor]:
    """slime's loaded tensors under their HF names (what the bridge converts from)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in loaded.items():
        m = _KEY.match(key)
        assert m is not None
        rest = m.group(2) if m.group(3) is not None else "input_layernorm.weight"
        out[f"{arch.hf_prefix}layers.{m.group(1)}.{rest}"] = tensor
    return out


class _Named:
    """The HF tensors as the bridge's loader reads them (`HFWeights.get`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"the checkpoint's linear-attention tensors hold no {name!r}")
        return self.tensors[name]


def apply(chunk: Any, load: WrappedLoad, loaded: dict[str, torch.Tensor]) -> int:
    """Copy this rank's share of the converted tensors into the chunk's linear-attention layers;
    returns how many parameters were set."""
    weights = bridge.weights_of(chunk)
    named = _Named(hf_tensors(loaded, weights.arch))
    return weights.load(chunk, named, bridge.Layout.current(), only=load.replaced)  # type: ignore[arg-type]

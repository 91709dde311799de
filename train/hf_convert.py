"""Weight conversion between Hugging Face (Llama/Qwen2/Qwen3 dense) and Megatron GPTModel shards.

Megatron names are those of GPTModel built with the local (non-TransformerEngine) layer spec.
Layouts (per tensor-parallel rank r of `tp`):
- linear_qkv: rows grouped per KV head `[q heads of the group, k, v]`; TP ranks hold whole groups.
- linear_fc1: `cat[gate_r, up_r]`, the r-th TP chunks of gate_proj and up_proj.
- linear_proj (o_proj) and linear_fc2 (down_proj): split on dim 1.
- word embeddings and output layer: rows padded to the TP-divisible vocab, split on dim 0.
- norms (input, pre-MLP, final, q/k layernorm): replicated.
Every conversion is a pure copy/reshape, so HF → Megatron → HF is bit-exact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from tether.runtime.errors import ConfigError
from tether.runtime.safe_paths import contained
from tether.train.hf_config import ModelArch

Kind = Literal["replicated", "vocab", "row", "qkv", "fc1"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix → (kind, HF suffixes under model.layers.{n}.)
_LAYER_MAP: dict[str, tuple[Kind, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}


@dataclass(frozen=True)
class ParamSpec:
    """How one Megatron parameter maps to HF tensors."""

    kind: Kind
    hf_names: tuple[str, ...]


def param_spec(arch: ModelArch, name: str, global_layer: Callable[[int], int]) -> ParamSpec:
    """The HF tensors behind Megatron parameter `name`; `global_layer` maps a chunk-local layer index."""
    m = _LAYER.match(name)
    if m:
        local, suffix = int(m.group(1)), m.group(2)
        if suffix not in _LAYER_MAP:
            raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
        kind, hf = _LAYER_MAP[suffix]
        n = global_layer(local)
        return ParamSpec(kind, tuple(f"model.layers.{n}.{s}" for s in hf))
    if name == "embedding.word_embeddings.weight":
        return ParamSpec("vocab", ("model.embed_tokens.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamSpec("replicated", ("model.norm.weight",))
    if name == "output_layer.weight":
        # With tied embeddings the last PP stage still holds its own copy of the embedding.
        return ParamSpec(
            "vocab", ("model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight",)
        )
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def _qkv_groups(arch: ModelArch) -> tuple[int, int]:
    return arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups


def hf_to_megatron(
    arch: ModelArch, spec: ParamSpec, hf: list[torch.Tensor], tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's shard of a Megatron parameter, built from its full HF tensors."""
    if spec.kind == "replicated":
        return hf[0]
    if spec.kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if spec.kind == "vocab":
        full = hf[0]
        pad = arch.padded_vocab_size(tp_size) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros((pad, *full.shape[1:]))])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if spec.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    # qkv: regroup rows per KV head, then hand each TP rank its whole groups.
    q, k, v = hf
    groups, per_group = _qkv_groups(arch)
    d = arch.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)],
        dim=1,
    )
    return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *tail)


def megatron_to_hf(
    arch: ModelArch, spec: ParamSpec, shards: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards (in TP rank order) of one Megatron parameter."""
    if spec.kind == "replicated":
        return [(spec.hf_names[0], shards[0])]
    if spec.kind == "row":
        return [(spec.hf_names[0], torch.cat(shards, dim=1))]
    if spec.kind == "vocab":
        return [(spec.hf_names[0], torch.cat(shards, dim=0)[: arch.vocab_size])]
    if spec.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves])
        up = torch.cat([h[1] for h in halves])
        return list(zip(spec.hf_names, (gate, up), strict=True))
    groups, per_group = _qkv_groups(arch)
    d = arch.head_dim
    full = torch.cat(shards, dim=0)
    tail = full.shape[1:]
    grouped = full.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return list(
        zip(
            spec.hf_names,
            (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)),
            strict=True,
        )
    )


class HFWeights:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            for name, shard in weight_map.items():
                # Joined to the directory below: a name leaving it would read any file.
                contained(self.dir, shard, entry=f"{index.name} weight_map[{name!r}]")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ConfigError("--hf-checkpoint", str(hf_dir), "contains no *.safetensors weights")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    weight_map.update(dict.fromkeys(h.keys(), f.name))
        self.weight_map = weight_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        shard = contained(self.dir, self.weight_map[name], entry=f"weight_map[{name!r}]")
        with safe_open(str(shard), framework="pt") as h:
            return h.get_tensor(name)


def layer_numbering(chunk: Any) -> Callable[[int], int]:
    """Chunk-local layer index → global 0-based layer number (Megatron's own layer offsets)."""
    numbers = [int(layer.layer_number) - 1 for layer in chunk.decoder.layers]
    return lambda local: numbers[local]


def load_hf_into(chunk: Any, arch: ModelArch, weights: HFWeights, tp_rank: int, tp_size: int) -> int:
    """Copy HF weights into every parameter of one GPTModel chunk; returns the count loaded."""
    module = chunk
    while hasattr(module, "module"):
        module = module.module
    numbering = layer_numbering(module)
    count = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            spec = param_spec(arch, name, numbering)
            shard = hf_to_megatron(arch, spec, [weights.get(n) for n in spec.hf_names], tp_rank, tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: HF {spec.hf_names} give shard shape {tuple(shard.shape)}, "
                    f"Megatron expects {tuple(param.shape)}"
                )
            param.copy_(shard.to(param.dtype))
            count += 1
    return count

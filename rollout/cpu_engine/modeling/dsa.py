"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) for the CPU engine: the indexer that picks,
for each query, the `index_topk` keys multi-latent attention (mla.py) then attends to.

Per layer the indexer has its own query heads, read off MLA's normed query latent (wq_b), and one
key per token (wk, then a LayerNorm with bias), both rotated on their first qk_rope_head_dim dims
with the model's RoPE tables: adjacent pairs for GLM-5, halves for DeepSeek-V3.2. A key's score
for a query is the sum over heads of relu(q·k / sqrt(index_head_dim)) weighted by
weights_proj(x) / sqrt(index_n_heads), in float32; the top-k causal keys are kept. The keys are
cached per token beside MLA's latent (the KV cache's second store), so a decode step scores the
new query against every earlier key. GLM-5's "shared" layers (indexer_types) have no indexer and
reuse the choice of the last layer that ran one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import torch
import torch.nn.functional as F

# transformers builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6), whatever the
# config's norm epsilon.
KEY_NORM_EPS = 1e-6

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DSAConfig(msgspec.Struct, frozen=True, kw_only=True):
    heads: int  # index_n_heads
    dim: int  # index_head_dim
    topk: int  # index_topk
    rope_dim: int  # qk_rope_head_dim: the leading dims of q and k that RoPE rotates
    half_rope: bool  # DeepSeek-V3.2 rotates halves; GLM-5 adjacent pairs, as its MLA does
    full_layers: tuple[bool, ...]  # per layer: runs its own indexer (else reuses the last one's choice)

    @classmethod
    def from_raw(cls, model_type: str, raw: dict[str, Any], layers: int) -> DSAConfig:
        """The indexer section of a glm_moe_dsa / deepseek_v32 config.json (ValueError naming the key)."""

        def need(key: str) -> int:
            value = raw.get(key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive int")
            return value

        if not raw.get("q_lora_rank"):
            raise ValueError("q_lora_rank is missing (the indexer's queries come from the query latent)")
        rope_dim, dim = need("qk_rope_head_dim"), need("index_head_dim")
        if dim < rope_dim:
            raise ValueError(f"index_head_dim={dim} is smaller than qk_rope_head_dim={rope_dim}")
        full = _full_layers(raw, layers) if model_type == "glm_moe_dsa" else (True,) * layers
        return cls(
            heads=need("index_n_heads"),
            dim=dim,
            topk=need("index_topk"),
            rope_dim=rope_dim,
            half_rope=model_type == "deepseek_v32",
            full_layers=full,
        )

    def expected_shapes(self, layer: int, hidden: int, q_lora_rank: int) -> dict[str, tuple[int, ...]]:
        """Layer `layer`'s indexer parameters (none on a shared layer), by Hugging Face name."""
        if not self.full_layers[layer]:
            return {}
        p = f"model.layers.{layer}.self_attn.indexer."
        return {
            p + "wq_b.weight": (self.heads * self.dim, q_lora_rank),
            p + "wk.weight": (self.dim, hidden),
            p + "k_norm.weight": (self.dim,),
            p + "k_norm.bias": (self.dim,),
            p + "weights_proj.weight": (self.heads, hidden),
        }


def _full_layers(raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """GLM-5's indexer_types as transformers' GlmMoeDsaConfig reads them: the list when given, else
    the pattern index_topk_pattern ("F"/"S" per layer), else every index_topk_freq-th layer from
    index_skip_topk_offset on runs the indexer (the layers before the offset all do)."""
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if isinstance(pattern, str):
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        elif pattern is not None:
            types = pattern
        else:
            freq = max(int(raw.get("index_topk_freq") or 1), 1)
            offset = raw.get("index_skip_topk_offset")
            offset = 2 if offset is None else int(offset)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if not (isinstance(types, list) and len(types) == layers and all(t in ("full", "shared") for t in types)):
        raise ValueError(
            f"indexer_types={types!r} must list 'full' or 'shared' for each of the {layers} layers"
        )
    if types[0] != "full":
        raise ValueError(f"indexer_types={types!r}: layer 0 is 'shared' with no earlier indexer to share")
    return tuple(t == "full" for t in types)


class IndexQuery(NamedTuple):
    """One layer's indexer queries for the step's tokens: q [B, T, heads, dim] (rotated) and each
    head's weight [B, T, heads] (float32, with the 1/sqrt(heads) folded in)."""

    q: torch.Tensor
    weights: torch.Tensor


def index_keys(
    cfg: DSAConfig,
    params: dict[str, torch.Tensor],
    layer: int,
    h: torch.Tensor,
    pos: torch.Tensor,
    rope: Rope,
) -> torch.Tensor:
    """The indexer's keys [B, 1, T, dim] for h [B, T, D] (what its cache store keeps); a shared
    layer keeps none ([B, 0, T, dim])."""
    b, t, _ = h.shape
    if not cfg.full_layers[layer]:
        return h.new_empty(b, 0, t, cfg.dim)
    p = f"model.layers.{layer}.self_attn.indexer."
    k = F.layer_norm(
        F.linear(h, params[p + "wk.weight"]),
        (cfg.dim,),
        params[p + "k_norm.weight"],
        params[p + "k_norm.bias"],
        KEY_NORM_EPS,
    )
    return rope(k.unsqueeze(1), pos)


def index_query(
    cfg: DSAConfig,
    params: dict[str, torch.Tensor],
    layer: int,
    h: torch.Tensor,
    q_latent: torch.Tensor,
    pos: torch.Tensor,
    rope: Rope,
) -> IndexQuery | None:
    """Layer `layer`'s indexer queries for h [B, T, D] and MLA's query latent [B, T, q_lora_rank];
    None on a shared layer."""
    if not cfg.full_layers[layer]:
        return None
    p = f"model.layers.{layer}.self_attn.indexer."
    b, t, _ = h.shape
    q = F.linear(q_latent, params[p + "wq_b.weight"]).view(b, t, cfg.heads, cfg.dim)
    q = rope(q.transpose(1, 2), pos).transpose(1, 2)
    # transformers keeps weights_proj in float32 whatever the model's dtype.
    weights = F.linear(h.float(), params[p + "weights_proj.weight"].float()) * cfg.heads**-0.5
    return IndexQuery(q, weights)


def select(cfg: DSAConfig, query: IndexQuery, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Which keys each query attends to [B, T, S] (bool): the top-k by the indexer's score among
    the keys `valid` [B, T, S] lets it see (all of them when there are no more than k), over the
    cached keys [B, 1, S, dim]."""
    # The products in transformers' layout ([B, T, heads, S], then the heads' weighted sum), so
    # near-equal scores order as they do there.
    scores = torch.matmul(query.q.float(), keys.float().transpose(-1, -2)) * cfg.dim**-0.5
    total = torch.matmul(query.weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)
    total = total.masked_fill(~valid, float("-inf"))
    top = total.topk(min(cfg.topk, total.shape[-1]), dim=-1).indices
    return torch.zeros_like(valid).scatter_(-1, top, True) & valid

"""Multi-latent attention (DeepSeek-V3's, as GLM-4.7-Flash and Kimi-K2 use it) for the CPU engine.

Queries come from a low-rank projection with its own norm (q_a_proj → q_a_layernorm →
q_b_proj) or a plain q_proj when there is no q_lora_rank. Keys and values share one latent per
token (kv_a_proj_with_mqa → kv_a_layernorm) plus a single rotary key part; the KV cache keeps
exactly that — the normed latent and the rotated key part, one "head" of width
kv_lora_rank + qk_rope_head_dim — and kv_b_proj expands the cached latents into per-head keys
and values at each step. RoPE applies to the rope part of q and k only; DeepSeek's
interleaved rope layout (`rope_interleave`) is the pairwise rotation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAConfig(msgspec.Struct, frozen=True, kw_only=True):
    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> MLAConfig:
        def need(key: str) -> int:
            if raw.get(key) is None:
                raise ValueError(f"{key} is missing")
            return int(raw[key])

        return cls(
            q_lora_rank=int(raw.get("q_lora_rank") or 0),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_dim=need("qk_nope_head_dim"),
            qk_rope_dim=need("qk_rope_head_dim"),
            v_dim=need("v_head_dim"),
        )

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    def expected_shapes(self, layer: int, hidden: int, heads: int) -> dict[str, tuple[int, ...]]:
        p = f"model.layers.{layer}.self_attn."
        shapes: dict[str, tuple[int, ...]] = {
            p + "kv_a_proj_with_mqa.weight": (self.cache_width, hidden),
            p + "kv_a_layernorm.weight": (self.kv_lora_rank,),
            p + "kv_b_proj.weight": (heads * (self.qk_nope_dim + self.v_dim), self.kv_lora_rank),
            p + "o_proj.weight": (hidden, heads * self.v_dim),
        }
        if self.q_lora_rank:
            shapes |= {
                p + "q_a_proj.weight": (self.q_lora_rank, hidden),
                p + "q_a_layernorm.weight": (self.q_lora_rank,),
                p + "q_b_proj.weight": (heads * self.qk_dim, self.q_lora_rank),
            }
        else:
            shapes[p + "q_proj.weight"] = (heads * self.qk_dim, hidden)
        return shapes


Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def mla_project(
    cfg: MLAConfig,
    heads: int,
    params: dict[str, torch.Tensor],
    layer: int,
    h: torch.Tensor,
    pos: torch.Tensor,
    rope: Rope,
    norm: Norm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [B, H, T, qk_dim], cache entry [B, 1, T, kv_lora_rank + qk_rope_dim], the normed query
    latent [B, T, q_lora_rank] or None without one: DSA's indexer reads it) for h [B, T, D]."""
    p = f"model.layers.{layer}.self_attn."
    b, t, _ = h.shape
    q_latent = None
    if cfg.q_lora_rank:
        q_latent = norm(
            F.linear(h, params[p + "q_a_proj.weight"]), params[p + "q_a_layernorm.weight"], LATENT_NORM_EPS
        )
        q = F.linear(q_latent, params[p + "q_b_proj.weight"])
    else:
        q = F.linear(h, params[p + "q_proj.weight"])
    q = q.view(b, t, heads, cfg.qk_dim).transpose(1, 2)
    q_nope, q_rot = q.split([cfg.qk_nope_dim, cfg.qk_rope_dim], dim=-1)
    kv = F.linear(h, params[p + "kv_a_proj_with_mqa.weight"])
    latent, k_rot = kv.split([cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
    latent = norm(latent, params[p + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_rot = rope(k_rot.unsqueeze(1), pos)  # [B, 1, T, rope]
    q = torch.cat((q_nope, rope(q_rot, pos)), dim=-1)
    return q, torch.cat((latent.unsqueeze(1), k_rot), dim=-1), q_latent


def mla_attend(
    cfg: MLAConfig,
    heads: int,
    params: dict[str, torch.Tensor],
    layer: int,
    q: torch.Tensor,
    cached: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output [B, T, H * v_dim] of q [B, H, T, qk] over cached entries [B, 1, S, w];
    `scale` is the softmax scale (qk_dim**-0.5, times YaRN's mscale_all_dim factor)."""
    p = f"model.layers.{layer}.self_attn."
    b, _, s, _ = cached.shape
    latent, k_rot = cached[:, 0].split([cfg.kv_lora_rank, cfg.qk_rope_dim], dim=-1)
    kv = F.linear(latent, params[p + "kv_b_proj.weight"]).view(b, s, heads, cfg.qk_nope_dim + cfg.v_dim)
    k_nope, v = kv.transpose(1, 2).split([cfg.qk_nope_dim, cfg.v_dim], dim=-1)
    k = torch.cat((k_nope, k_rot.unsqueeze(1).expand(b, heads, s, cfg.qk_rope_dim)), dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(b, q.shape[2], heads * cfg.v_dim)

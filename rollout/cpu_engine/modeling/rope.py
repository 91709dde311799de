"""Rotary position tables for the CPU engine: plain RoPE and YaRN.

YaRN (rope type "yarn": Qwen, Llama variants, DeepSeek-V3/Kimi/Moonlight) blends each
frequency between its original value (fast dims, extrapolated) and the value divided by
`factor` (slow dims, interpolated), with a linear ramp between the dims that make `beta_fast`
and `beta_slow` turns over `original_max_position_embeddings`; the tables are then multiplied
by an attention factor. Multi-latent attention (DeepSeek) adds a second factor, mscale_all_dim's,
squared into the softmax scale. The formulas follow the YaRN paper as transformers computes
them (modeling_rope_utils, the deepseek_v3 attention), so the engine's log-probs equal theirs.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch


class YarnConfig(msgspec.Struct, frozen=True, kw_only=True):
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit: replaces the one derived from the mscales
    truncate: bool = True  # round the ramp's ends to whole dims

    @classmethod
    def from_params(cls, params: dict[str, Any], max_position: int) -> YarnConfig:
        """From a config's `rope_parameters` (transformers 5) or `rope_scaling` (earlier) dict."""
        original = int(params.get("original_max_position_embeddings") or max_position)
        factor = params.get("factor")
        # DeepSeek-style configs may leave the factor implied by the two context lengths.
        factor = float(factor) if factor is not None else max_position / original
        if factor <= 0:
            raise ValueError(f"rope scaling factor={factor} must be positive")

        def opt(key: str) -> float | None:
            value = params.get(key)
            return None if value is None else float(value)

        return cls(
            factor=factor,
            original_max_position=original,
            # transformers treats a missing (or zero) beta as the paper's default.
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
            attention_factor=opt("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    def table_scale(self) -> float:
        """The factor cos and sin are multiplied by (so q·k scales by its square)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor, 1.0)

    def mla_softmax_scale(self) -> float:
        """Multi-latent attention's extra softmax-scale factor: mscale(factor, mscale_all_dim)²."""
        if not self.mscale_all_dim:
            return 1.0
        m = _mscale(self.factor, self.mscale_all_dim)
        return m * m


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """The dim/2 inverse frequencies of a rotary dim `dim`, YaRN-blended when `yarn` is given."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(turns: float) -> float:
        return dim * math.log(yarn.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency; 0: divide it by the factor
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_tables(
    dim: int, theta: float, max_position: int, pairs: bool, yarn: YarnConfig | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_position, dim]: halves repeated (rotate-half) or each pair's twice."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq(dim, theta, yarn))
    emb = freqs.repeat_interleave(2, dim=-1) if pairs else torch.cat((freqs, freqs), dim=-1)
    scale = 1.0 if yarn is None else yarn.table_scale()
    return emb.cos() * scale, emb.sin() * scale

"""Qwen3-Next's linear-attention layer for the CPU engine: the gated delta net (GDN), over
parameters under their Hugging Face names (`model.layers.{i}.linear_attn.*`).

One layer projects the hidden states into queries and keys (`k_heads` of `k_dim`), values and
an output gate z (`v_heads` of `v_dim`), and per value head a write strength b and a decay
input a. Queries, keys and values pass a causal depthwise convolution (kernel `conv_kernel`,
SiLU) before the delta rule: per value head a state S [k_dim, v_dim] decays by exp(g), then
moves towards v along k with strength beta = sigmoid(b), and a query reads it out:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}' k_t exp(g_t)))'      o_t = S_t' q_t

with q and k L2-normalised and q scaled by k_dim^-1/2, g_t = -exp(A_log) softplus(a_t + dt_bias).
The output is RMS-normalised per head, gated by SiLU(z) and projected back.

What a sequence carries between steps is therefore not one entry per token but two fixed-size
states: the convolution's last `conv_kernel - 1` inputs and S. Prefill runs a whole prompt in
chunks of 64 tokens (the chunked form of the same recurrence: within a chunk the writes are
solved as one triangular system) and leaves both states; a decode step advances them by one
token. The formulas follow transformers' torch fallbacks (modeling_qwen3_next), so log-probs
equal theirs.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.nn.functional as F

CHUNK = 64  # prefill's chunk length (transformers' and the FLA kernels' default)


class GDNConfigError(ValueError):
    """The config's linear-attention section cannot be served (names the key)."""


class GDNConfig(msgspec.Struct, frozen=True, kw_only=True):
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    linear_layers: tuple[bool, ...]  # per layer: linear attention (True) or full attention
    # Qwen3.5: the input projections apart (in_proj_qkv: all queries, keys, values; in_proj_z,
    # in_proj_b, in_proj_a), not grouped per key head in two (Qwen3-Next's in_proj_qkvz, in_proj_ba).
    split_proj: bool = False

    @classmethod
    def from_raw(cls, raw: dict[str, Any], layers: int, split_proj: bool = False) -> GDNConfig:
        def need(key: str, default: int) -> int:
            value = raw.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GDNConfigError(f"{key}={value!r} must be a positive integer")
            return value

        types = raw.get("layer_types")
        if types is None:  # transformers derives them from full_attention_interval
            interval = need("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        if not (
            isinstance(types, list)
            and len(types) == layers
            and all(t in ("linear_attention", "full_attention") for t in types)
        ):
            raise GDNConfigError(
                f"layer_types={types!r} must list 'linear_attention' or 'full_attention' for each of "
                f"the {layers} layers"
            )
        cfg = cls(
            k_heads=need("linear_num_key_heads", 16),
            v_heads=need("linear_num_value_heads", 32),
            k_dim=need("linear_key_head_dim", 128),
            v_dim=need("linear_value_head_dim", 128),
            conv_kernel=need("linear_conv_kernel_dim", 4),
            linear_layers=tuple(t == "linear_attention" for t in types),
            split_proj=split_proj,
        )
        if cfg.v_heads % cfg.k_heads:
            raise GDNConfigError(
                f"linear_num_value_heads={cfg.v_heads} is not a multiple of linear_num_key_heads={cfg.k_heads}"
            )
        return cfg

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: the convolution's window [conv_dim, kernel - 1] and S [v_heads, k_dim, v_dim]."""
        return (self.conv_dim, self.conv_kernel - 1), (self.v_heads, self.k_dim, self.v_dim)

    def expected_shapes(self, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        p = f"model.layers.{layer}.linear_attn."
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        projections = (
            {
                p + "in_proj_qkv.weight": (2 * key + value, hidden),
                p + "in_proj_z.weight": (value, hidden),
                p + "in_proj_b.weight": (self.v_heads, hidden),
                p + "in_proj_a.weight": (self.v_heads, hidden),
            }
            if self.split_proj
            else {
                p + "in_proj_qkvz.weight": (2 * key + 2 * value, hidden),
                p + "in_proj_ba.weight": (2 * self.v_heads, hidden),
            }
        )
        return {
            **projections,
            p + "conv1d.weight": (self.conv_dim, 1, self.conv_kernel),
            p + "dt_bias": (self.v_heads,),
            p + "A_log": (self.v_heads,),
            p + "norm.weight": (self.v_dim,),
            p + "out_proj.weight": (hidden, value),
        }


class Projected(msgspec.Struct, frozen=True):
    """One layer's inputs to the convolution and the delta rule, for x [B, T, D]."""

    mixed: torch.Tensor  # [B, conv_dim, T]: queries, keys and values before the convolution
    z: torch.Tensor  # [B, T, v_heads, v_dim]: the output gate
    beta: torch.Tensor  # [B, T, v_heads]
    g: torch.Tensor  # [B, T, v_heads], float32: the log decay


def project(cfg: GDNConfig, params: dict[str, torch.Tensor], layer: int, x: torch.Tensor) -> Projected:
    """Split the input projections. Qwen3-Next's two group them by key head: for each of the
    k_heads, its query, key, its share of value heads' values and of their gates (and of b, a);
    Qwen3.5's four hold each part whole (`GDNConfig.split_proj`)."""
    p = f"model.layers.{layer}.linear_attn."
    b, t, _ = x.shape
    if cfg.split_proj:  # Qwen3.5: already [all queries, all keys, all values], z, b, a apart
        mixed = F.linear(x, params[p + "in_proj_qkv.weight"])
        z = F.linear(x, params[p + "in_proj_z.weight"])
        bb, a = F.linear(x, params[p + "in_proj_b.weight"]), F.linear(x, params[p + "in_proj_a.weight"])
        g = -params[p + "A_log"].float().exp() * F.softplus(a.float() + params[p + "dt_bias"])
        return Projected(
            mixed=mixed.transpose(1, 2), z=z.reshape(b, t, cfg.v_heads, cfg.v_dim), beta=bb.sigmoid(), g=g
        )
    per = cfg.v_heads // cfg.k_heads
    qkvz = F.linear(x, params[p + "in_proj_qkvz.weight"]).view(b, t, cfg.k_heads, -1)
    q, k, v, z = torch.split(qkvz, [cfg.k_dim, cfg.k_dim, per * cfg.v_dim, per * cfg.v_dim], dim=-1)
    ba = F.linear(x, params[p + "in_proj_ba.weight"]).view(b, t, cfg.k_heads, 2 * per)
    bb, a = ba[..., :per].reshape(b, t, cfg.v_heads), ba[..., per:].reshape(b, t, cfg.v_heads)
    mixed = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1)
    g = -params[p + "A_log"].float().exp() * F.softplus(a.float() + params[p + "dt_bias"])
    return Projected(
        mixed=mixed.transpose(1, 2), z=z.reshape(b, t, cfg.v_heads, cfg.v_dim), beta=bb.sigmoid(), g=g
    )


def _split_heads(cfg: GDNConfig, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv_out [B, conv_dim, T] -> q, k [B, v_heads, T, k_dim] (key heads repeated to the value
    heads they serve), normalised and q scaled; v [B, v_heads, T, v_dim]; all float32."""
    b, _, t = conv_out.shape
    key = cfg.k_heads * cfg.k_dim
    q, k, v = torch.split(conv_out.transpose(1, 2).float(), [key, key, cfg.v_heads * cfg.v_dim], dim=-1)
    q = q.reshape(b, t, cfg.k_heads, cfg.k_dim)
    k = k.reshape(b, t, cfg.k_heads, cfg.k_dim)
    v = v.reshape(b, t, cfg.v_heads, cfg.v_dim)
    per = cfg.v_heads // cfg.k_heads
    if per > 1:
        q, k = q.repeat_interleave(per, dim=2), k.repeat_interleave(per, dim=2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (cfg.k_dim**0.5)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _chunked_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over a whole sequence from a zero state, CHUNK tokens at a time.

    q, k [B, H, T, dk], v [B, H, T, dv], beta and g [B, H, T], float32. Returns the outputs
    [B, H, T, dv] and the final state [B, H, dk, dv]. The tail is padded with zero tokens
    (no key, no write, no decay), which leave the state as it was."""
    bsz, heads, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (t + pad) // CHUNK
    q, k, v = (x.reshape(bsz, heads, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(bsz, heads, n, CHUNK), g.reshape(bsz, heads, n, CHUNK)
    cum = g.cumsum(-1)  # log decay from each chunk's start through each token
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (what token j's write has decayed by at i).
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, 0.0).exp().masked_fill(~lower, 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Within a chunk each write corrects what the earlier writes left along its key: the writes
    # solve (I + L) W = beta V with L strictly lower, L[i, j] = beta_i (k_i . k_j) decay[i, j].
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~lower.tril(-1), 0.0) + eye
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    writes = inverse @ v_beta  # each token's write, before the state's contribution is taken out
    state_keys = inverse @ (k_beta * cum.exp()[..., None])  # how each write reads the chunk's entry state
    state = q.new_zeros(bsz, heads, dk, dv)
    out = torch.empty_like(v)
    reads = (q @ k.transpose(-1, -2)) * decay  # intra-chunk query-key weights, causal
    for c in range(n):
        fresh = writes[:, :, c] - state_keys[:, :, c] @ state
        out[:, :, c] = (q[:, :, c] * cum[:, :, c, :, None].exp()) @ state + reads[:, :, c] @ fresh
        last = cum[:, :, c, -1]
        state = (
            state * last.exp()[..., None, None]
            + (k[:, :, c] * (last[..., None] - cum[:, :, c]).exp()[..., None]).transpose(-1, -2) @ fresh
        )
    out = out.reshape(bsz, heads, n * CHUNK, dv)[:, :, :t]
    return out, state


def _gated_norm(
    cfg: GDNConfig, params: dict[str, torch.Tensor], layer: int, o: torch.Tensor, z: torch.Tensor, eps: float
) -> torch.Tensor:
    """o [B, T, v_heads, v_dim] RMS-normalised per head, scaled, gated by SiLU(z): [B, T, value]."""
    p = f"model.layers.{layer}.linear_attn."
    dtype = z.dtype
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = (params[p + "norm.weight"] * normed) * F.silu(z.float())
    return y.to(dtype).flatten(2)


def prefill(
    cfg: GDNConfig, params: dict[str, torch.Tensor], layer: int, x: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence x [1, T, D] from empty states: (output [1, T, D], conv window
    [1, conv_dim, kernel - 1], state [1, v_heads, k_dim, v_dim] float32)."""
    p = f"model.layers.{layer}.linear_attn."
    proj = project(cfg, params, layer, x)
    t = x.shape[1]
    weight = params[p + "conv1d.weight"]
    conv = F.silu(F.conv1d(proj.mixed, weight, padding=cfg.conv_kernel - 1, groups=cfg.conv_dim)[..., :t])
    window = F.pad(proj.mixed, (max(0, cfg.conv_kernel - 1 - t), 0))[..., -(cfg.conv_kernel - 1) :]
    q, k, v = _split_heads(cfg, conv)
    o, state = _chunked_rule(q, k, v, proj.beta.float().transpose(1, 2), proj.g.transpose(1, 2))
    y = _gated_norm(cfg, params, layer, o.transpose(1, 2).to(x.dtype), proj.z, eps)
    return F.linear(y, params[p + "out_proj.weight"]), window.contiguous(), state


def decode(
    cfg: GDNConfig,
    params: dict[str, torch.Tensor],
    layer: int,
    x: torch.Tensor,
    window: torch.Tensor,
    state: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per sequence, x [B, 1, D], from each one's conv window and state: (output
    [B, 1, D], the new window, the new state)."""
    p = f"model.layers.{layer}.linear_attn."
    proj = project(cfg, params, layer, x)
    full = torch.cat((window, proj.mixed), dim=-1)  # [B, conv_dim, kernel]
    weight = params[p + "conv1d.weight"]
    conv = F.silu((full * weight[:, 0]).sum(-1, keepdim=True))
    q, k, v = _split_heads(cfg, conv)  # [B, H, 1, d]
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    beta, g = proj.beta[:, 0].float(), proj.g[:, 0]
    s = state.float() * g.exp()[..., None, None]
    delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    o = (s * q[..., None]).sum(-2)  # [B, H, dv]
    y = _gated_norm(cfg, params, layer, o[:, None].to(x.dtype), proj.z, eps)
    return F.linear(y, params[p + "out_proj.weight"]), full[..., 1:].contiguous(), s

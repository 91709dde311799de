"""The CPU engine's model: a compact pure-torch forward for Llama, Qwen2 and Qwen3 with a
slot-based KV cache, so one decode step runs every running sequence in one forward.

Supported: RMSNorm, RoPE (default rope type, theta from `rope_parameters` or `rope_theta`),
GQA, SwiGLU, qkv bias (Qwen2, or `attention_bias`), per-head q/k RMSNorm (Qwen3), tied
embeddings. Weights keep their Hugging Face names, so every update path speaks the names a
trainer exports.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")


class ModelConfigError(ValueError):
    """The model directory cannot be served (names the file or the config key)."""


class WeightMismatch(ValueError):
    """A set of named tensors does not fit the model (names the tensor and what is wrong)."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"{cfg_path}: cannot read config: {e}") from e
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise ModelConfigError(f"{cfg_path}: model_type={model_type!r} is not one of {SUPPORTED_TYPES}")
        rope = raw.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default" or raw.get("rope_scaling"):
            raise ModelConfigError(f"{cfg_path}: rope scaling {rope_type!r} is not supported")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = float(theta if theta is not None else raw.get("rope_theta", 10000.0))
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        gen_path = Path(path) / "generation_config.json"
        if gen_path.exists():
            try:
                gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:
                raise ModelConfigError(f"{gen_path}: cannot read the generation config: {e}") from e
            if isinstance(gen_eos, list):
                eos_ids = tuple(dict.fromkeys([*eos_ids, *gen_eos]))
            elif gen_eos is not None and gen_eos not in eos_ids:
                eos_ids = (*eos_ids, int(gen_eos))
        return cls(
            model_type=model_type,
            hidden=hidden,
            layers=int(raw["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]),
            eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter the model needs, by Hugging Face name."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab, self.hidden),
            "model.norm.weight": (self.hidden,),
        }
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (self.hidden,),
                p + "post_attention_layernorm.weight": (self.hidden,),
                p + "self_attn.q_proj.weight": (q, self.hidden),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, q),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
            }
            if self.qkv_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            if self.qk_norm:
                shapes |= {
                    p + "self_attn.q_norm.weight": (self.head_dim,),
                    p + "self_attn.k_norm.weight": (self.head_dim,),
                }
        return shapes


def check_named(cfg: ModelConfig, named: dict[str, torch.Tensor], complete: bool) -> None:
    """Raise WeightMismatch unless every tensor has a known name, float32 dtype and its shape.

    `complete` also requires every parameter to be present (a full checkpoint load). Tied
    checkpoints may carry an `lm_head.weight` equal to the embeddings; it is accepted and ignored.
    """
    expected = cfg.expected_shapes()
    for name, tensor in named.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name not in expected:
            raise WeightMismatch(f"unknown parameter name {name!r}")
        if tuple(tensor.shape) != expected[name]:
            raise WeightMismatch(f"{name}: shape {tuple(tensor.shape)} != expected {expected[name]}")
        if not tensor.dtype.is_floating_point:
            raise WeightMismatch(f"{name}: dtype {tensor.dtype} is not a floating point type")
    if complete:
        missing = sorted(set(expected) - set(named))
        if missing:
            raise WeightMismatch(f"missing parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `path` (sharded checkpoints included)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{path}: no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            # A corrupt or truncated shard is the caller's bad input (400), named by its file.
            raise ModelConfigError(f"{file}: not a readable safetensors file: {e}") from e
    return out


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None when all are finite."""
    with torch.inference_mode():
        for name, tensor in named:
            if not tensor.dtype.is_floating_point:
                continue
            # One pass without an allocation: NaN and inf survive a sum, so a finite sum proves
            # every element finite; a non-finite one may only be an overflow, checked exactly.
            if torch.isfinite(tensor.sum()).item():
                continue
            if not bool(torch.isfinite(tensor).all()):
                return name
    return None


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """WeightMismatch naming the first tensor with NaN or inf (a diverged trainer's update)."""
    bad = first_nonfinite(named)
    if bad is not None:
        raise WeightMismatch(
            f"{bad}: holds NaN or inf values; the update is refused and nothing of it was applied "
            "(start the engine with --allow-nonfinite-weights to accept such weights)"
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Keys and values per layer in slots: [slots, kv_heads, capacity, head_dim].

    Slots and capacity grow by doubling, so the cache costs what the running batch needs.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.slots = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.free: list[int] = []

    def ensure(self, slots: int, capacity: int) -> None:
        new_slots, new_cap = max(self.slots, 1), max(self.capacity, 64)
        while new_slots < slots:
            new_slots *= 2
        while new_cap < capacity:
            new_cap *= 2
        if new_slots == self.slots and new_cap == self.capacity:
            return
        shape = (new_slots, self.cfg.kv_heads, new_cap, self.cfg.head_dim)
        for store in (self.k, self.v):
            for i in range(self.cfg.layers):
                fresh = torch.zeros(shape)
                if store[i:]:
                    fresh[: self.slots, :, : self.capacity] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.free.extend(range(self.slots, new_slots))
        self.slots, self.capacity = new_slots, new_cap

    def allocate(self, length: int) -> int:
        if not self.free:
            self.ensure(self.slots + 1, length)
        self.ensure(self.slots, length)
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()


class TinyLM:
    """The forward pass over parameters held in a plain dict (HF names → float32 tensors)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.params: dict[str, torch.Tensor] = {}
        # Flat receive buffers whose views are parameters (engine_receive's flattened buckets).
        self.arenas: dict[Hashable, torch.Tensor] = {}
        self.load(params, complete=True)
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        )
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def load(self, named: dict[str, torch.Tensor], complete: bool) -> None:
        """Validate, then replace; a mismatch raises before any parameter changes."""
        check_named(self.cfg, named, complete)
        for name, tensor in named.items():
            self.assign(name, tensor)

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        """Set one checked parameter, copying into the live tensor when there is one (no fresh
        allocation per update); a tied checkpoint's lm_head is dropped."""
        if self.ignores(name):
            return
        live = self.params.get(name)
        if live is not None and live.shape == tensor.shape:
            if live.data_ptr() != tensor.data_ptr():
                live.copy_(tensor.detach())
        else:
            self.params[name] = tensor.detach().to(torch.float32).contiguous().clone()

    dtype = torch.float32  # what every parameter is held in

    def ignores(self, name: str) -> bool:
        """A tied checkpoint's lm_head: accepted and dropped (the embeddings serve as the head)."""
        return name == "lm_head.weight" and self.cfg.tie_embeddings

    def adopt(self, name: str, tensor: torch.Tensor) -> None:
        """Make a checked float32 tensor the parameter itself (it becomes the storage, no copy)."""
        if self.ignores(name):
            return
        self.params[name] = tensor

    def receive_target(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor | None:
        """The live parameter a broadcast of (name, dtype, shape) can land in directly, if any."""
        live = self.params.get(name)
        if live is None or live.dtype != dtype or list(live.shape) != list(shape) or not live.is_contiguous():
            return None
        return live

    def drop(self) -> None:
        self.params = {}
        self.arenas = {}

    @property
    def loaded(self) -> bool:
        return bool(self.params)

    def _lm_head(self) -> torch.Tensor:
        key = "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"
        return self.params[key]

    def _attend_layer(
        self, i: int, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for hidden states h [B, T, D] at positions pos [B, T] (RoPE and norms applied)."""
        c, p = self.cfg, self.params
        pre = f"model.layers.{i}.self_attn."
        b, t, _ = h.shape
        q = F.linear(h, p[pre + "q_proj.weight"], p.get(pre + "q_proj.bias"))
        k = F.linear(h, p[pre + "k_proj.weight"], p.get(pre + "k_proj.bias"))
        v = F.linear(h, p[pre + "v_proj.weight"], p.get(pre + "v_proj.bias"))
        q = q.view(b, t, c.heads, c.head_dim)
        k = k.view(b, t, c.kv_heads, c.head_dim)
        v = v.view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q = _rms_norm(q, p[pre + "q_norm.weight"], c.eps)
            k = _rms_norm(k, p[pre + "k_norm.weight"], c.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _block_tail(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, self.params
        pre = f"model.layers.{i}."
        b, _, t, _ = attn.shape
        attn = attn.transpose(1, 2).reshape(b, t, c.heads * c.head_dim)
        x = x + F.linear(attn, p[pre + "self_attn.o_proj.weight"])
        h = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], c.eps)
        gate = F.silu(F.linear(h, p[pre + "mlp.gate_proj.weight"]))
        up = F.linear(h, p[pre + "mlp.up_proj.weight"])
        return x + F.linear(gate * up, p[pre + "mlp.down_proj.weight"])

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rep = self.cfg.heads // self.cfg.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def prefill(self, prompts: list[list[int]], slots: list[int], cache: KVCache) -> torch.Tensor:
        """Run whole prompts (right-padded into one batch), fill their slots; last-token logits [B, V]."""
        c = self.cfg
        lens = torch.tensor([len(x) for x in prompts])
        t = int(lens.max())
        tokens = torch.zeros(len(prompts), t, dtype=torch.long)
        for row, ids in enumerate(prompts):
            tokens[row, : len(ids)] = torch.tensor(ids)
        pos = torch.arange(t).expand(len(prompts), t)
        key_valid = torch.arange(t)[None, :] < lens[:, None]
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None] & key_valid[:, None, :]
        mask = mask[:, None]  # [B, 1, T, T]
        x = F.embedding(tokens, self.params["model.embed_tokens.weight"])
        for i in range(c.layers):
            h = _rms_norm(x, self.params[f"model.layers.{i}.input_layernorm.weight"], c.eps)
            q, k, v = self._attend_layer(i, h, pos)
            for row, slot in enumerate(slots):
                n = int(lens[row])
                cache.k[i][slot, :, :n] = k[row, :, :n]
                cache.v[i][slot, :, :n] = v[row, :, :n]
            x = self._block_tail(i, x, self._sdpa(q, k, v, mask))
        last = x[torch.arange(len(prompts)), lens - 1]
        return F.linear(_rms_norm(last, self.params["model.norm.weight"], c.eps), self._lm_head())

    def decode(
        self, tokens: list[int], positions: list[int], slots: list[int], cache: KVCache
    ) -> torch.Tensor:
        """One step for every running sequence at once: next-token logits [B, V]."""
        c = self.cfg
        b = len(tokens)
        slot_idx = torch.tensor(slots)
        pos = torch.tensor(positions)
        t = int(pos.max()) + 1
        mask = (torch.arange(t)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, T]
        x = F.embedding(torch.tensor(tokens).view(b, 1), self.params["model.embed_tokens.weight"])
        for i in range(c.layers):
            h = _rms_norm(x, self.params[f"model.layers.{i}.input_layernorm.weight"], c.eps)
            q, k, v = self._attend_layer(i, h, pos.view(b, 1))
            cache.k[i][slot_idx, :, pos] = k[:, :, 0]
            cache.v[i][slot_idx, :, pos] = v[:, :, 0]
            keys = cache.k[i][slot_idx, :, :t]
            values = cache.v[i][slot_idx, :, :t]
            x = self._block_tail(i, x, self._sdpa(q, keys, values, mask))
        return F.linear(_rms_norm(x[:, 0], self.params["model.norm.weight"], c.eps), self._lm_head())

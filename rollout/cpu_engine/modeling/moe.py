"""Mixture-of-Experts feed-forward blocks for the CPU engine (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Mixtral,
DeepSeek-V3 and its kin GLM-4.7-Flash, Kimi-K2, GLM-5 and DeepSeek-V3.2, GLM-4-MoE, MiniMax-M2), over
parameters under their Hugging Face names.

Routing follows each family's router in transformers: softmax over the router logits and a
top-k (Qwen, Mixtral), or sigmoid scores, a score-correction bias that only steers the choice,
expert groups of which the best `topk_group` stay eligible, and a scaling of the chosen
weights (DeepSeek-V3, GLM-4.7-Flash, Kimi-K2 and GLM-4-MoE: `noaux_tc`; MiniMax-M2 the same
without groups or scaling, under Mixtral's names). The block returns, beside its output, the
experts each token was routed to (what `return_routed_experts` reports).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import torch
import torch.nn.functional as F

from tether.rollout.cpu_engine.modeling.families import DEEPSEEK_ROUTER_MODEL_TYPES, DSA_MODEL_TYPES

Scoring = Literal["softmax", "sigmoid"]


class MoEConfigError(ValueError):
    """The config's MoE section cannot be served (names the key)."""


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True):
    experts: int
    top_k: int
    expert_ffn: int
    scoring: Scoring
    norm_topk: bool
    scaling: float  # routed_scaling_factor, applied to the chosen weights
    groups: int  # n_group (1: no grouping)
    topk_groups: int
    correction_bias: bool  # e_score_correction_bias steers the choice, not the weights
    shared_ffn: int  # the shared expert's FFN size (0: none)
    shared_gate: bool  # Qwen2-MoE and Qwen3-Next gate their shared expert with a sigmoid
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP (False)
    block: str  # the block's name under model.layers.{i}: "mlp" or "block_sparse_moe"
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    bias_name: str = "gate.e_score_correction_bias"  # the correction bias, under the block

    @classmethod
    def from_raw(cls, model_type: str, raw: dict[str, Any], layers: int) -> MoEConfig | None:
        """The MoE section of a config.json, or None for a dense family."""

        def need(key: str, *aliases: str) -> Any:
            # transformers 5 writes some keys under their attribute_map alias (num_local_experts).
            for name in (key, *aliases):
                if raw.get(name) is not None:
                    return raw[name]
            raise MoEConfigError(f"{key} is missing")

        if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"):
            experts = int(need("num_experts", "num_local_experts"))
            step = int(raw.get("decoder_sparse_step") or 1)
            only = {int(x) for x in raw.get("mlp_only_layers") or []}
            sparse = tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
            # Qwen2-MoE and Qwen3-Next gate their shared expert with a sigmoid; Qwen3-MoE has none.
            shared = int(raw.get("shared_expert_intermediate_size") or 0) if model_type != "qwen3_moe" else 0
            return cls(
                experts=experts,
                top_k=int(need("num_experts_per_tok")),
                expert_ffn=int(need("moe_intermediate_size")),
                scoring="softmax",
                norm_topk=bool(raw.get("norm_topk_prob", model_type in ("qwen3_next", "qwen3_5_moe"))),
                scaling=1.0,
                groups=1,
                topk_groups=1,
                correction_bias=False,
                shared_ffn=shared,
                shared_gate=shared > 0,
                sparse_layers=sparse,
                block="mlp",
                expert_names=("gate_proj", "up_proj", "down_proj"),
            )
        if model_type == "mixtral":
            return cls(
                experts=int(need("num_local_experts", "num_experts")),
                top_k=int(need("num_experts_per_tok")),
                expert_ffn=int(need("intermediate_size")),
                scoring="softmax",
                norm_topk=True,
                scaling=1.0,
                groups=1,
                topk_groups=1,
                correction_bias=False,
                shared_ffn=0,
                shared_gate=False,
                sparse_layers=(True,) * layers,
                block="block_sparse_moe",
                expert_names=("w1", "w3", "w2"),
            )
        if model_type == "minimax_m2":
            return cls(
                experts=int(need("num_local_experts", "num_experts")),
                top_k=int(need("num_experts_per_tok")),
                expert_ffn=int(need("intermediate_size")),
                scoring="sigmoid",
                norm_topk=True,
                scaling=1.0,
                groups=1,
                topk_groups=1,
                correction_bias=True,
                shared_ffn=0,
                shared_gate=False,
                sparse_layers=(True,) * layers,
                block="block_sparse_moe",
                expert_names=("w1", "w3", "w2"),
                bias_name="e_score_correction_bias",
            )
        if model_type in DEEPSEEK_ROUTER_MODEL_TYPES:
            for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
                if raw.get(key) not in (None, want):
                    raise MoEConfigError(
                        f"{key}={raw[key]!r} is not supported ({model_type} routes with {want})"
                    )
            if int(raw.get("moe_layer_freq") or 1) != 1:
                raise MoEConfigError(f"moe_layer_freq={raw['moe_layer_freq']!r} is not supported (only 1)")
            experts = int(need("n_routed_experts", "num_local_experts"))
            groups = int(raw.get("n_group") or 1)
            if experts % groups:
                raise MoEConfigError(f"n_group={groups} does not divide n_routed_experts={experts}")
            ffn = int(need("moe_intermediate_size"))
            return cls(
                experts=experts,
                top_k=int(need("num_experts_per_tok")),
                expert_ffn=ffn,
                scoring="sigmoid",
                norm_topk=bool(raw.get("norm_topk_prob", True)),
                scaling=float(raw.get("routed_scaling_factor") or 1.0),
                groups=groups,
                topk_groups=int(raw.get("topk_group") or 1),
                correction_bias=True,
                shared_ffn=ffn * int(raw.get("n_shared_experts") or 0),
                shared_gate=False,
                sparse_layers=_deepseek_sparse_layers(model_type, raw, layers),
                block="mlp",
                expert_names=("gate_proj", "up_proj", "down_proj"),
            )
        return None

    def shared_prefix(self) -> str:
        return "shared_expert" if self.shared_gate else "shared_experts"

    def expected_shapes(self, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """The parameters of layer `layer`'s MoE block, by Hugging Face name."""
        p = f"model.layers.{layer}.{self.block}."
        g, u, d = self.expert_names
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (self.experts, hidden)}
        if self.correction_bias:
            shapes[p + self.bias_name] = (self.experts,)
        for e in range(self.experts):
            shapes |= {
                f"{p}experts.{e}.{g}.weight": (self.expert_ffn, hidden),
                f"{p}experts.{e}.{u}.weight": (self.expert_ffn, hidden),
                f"{p}experts.{e}.{d}.weight": (hidden, self.expert_ffn),
            }
        if self.shared_ffn:
            s = p + self.shared_prefix() + "."
            shapes |= {
                s + "gate_proj.weight": (self.shared_ffn, hidden),
                s + "up_proj.weight": (self.shared_ffn, hidden),
                s + "down_proj.weight": (hidden, self.shared_ffn),
            }
            if self.shared_gate:
                shapes[p + "shared_expert_gate.weight"] = (1, hidden)
        return shapes


def _deepseek_sparse_layers(model_type: str, raw: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """MoE layers after first_k_dense_replace dense ones; GLM-4.7-Flash's as transformers'
    Glm4MoeLite reads them: mlp_layer_types when given (any pattern), else layer 0 dense only;
    GLM-5's and DeepSeek-V3.2's mlp_layer_types when given, else first_k_dense_replace (default 3)."""
    types = raw.get("mlp_layer_types")
    if model_type in DSA_MODEL_TYPES and types is None:
        first_dense = raw.get("first_k_dense_replace")
        return tuple(i >= (3 if first_dense is None else int(first_dense)) for i in range(layers))
    if model_type not in ("glm4_moe_lite", *DSA_MODEL_TYPES):
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        return tuple(i >= first_dense for i in range(layers))
    if types is None:
        if raw.get("first_k_dense_replace") not in (None, 1):
            raise MoEConfigError(
                f"first_k_dense_replace={raw['first_k_dense_replace']!r} is not supported without "
                "mlp_layer_types (transformers' Glm4MoeLite then keeps only layer 0 dense)"
            )
        return tuple(i > 0 for i in range(layers))
    if not (
        isinstance(types, list) and len(types) == layers and all(t in ("dense", "sparse") for t in types)
    ):
        raise MoEConfigError(
            f"mlp_layer_types={types!r} must list 'dense' or 'sparse' for each of the {layers} layers"
        )
    return tuple(t == "sparse" for t in types)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def route(
    cfg: MoEConfig, x: torch.Tensor, params: dict[str, torch.Tensor], prefix: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k], their weights [N, k]) for tokens x [N, D]."""
    logits = F.linear(x.float(), params[prefix + "gate.weight"].float())
    if cfg.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * cfg.scaling if cfg.scaling != 1.0 else weights
    scores = logits.sigmoid()
    choice = scores + params[prefix + cfg.bias_name] if cfg.correction_bias else scores
    if cfg.groups > 1:
        per_group = cfg.experts // cfg.groups
        # A group's score is the sum of its two best experts (DeepSeek-V3's rule).
        group_scores = choice.view(-1, cfg.groups, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        keep = torch.topk(group_scores, cfg.topk_groups, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(per_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.scaling


def moe_block(
    cfg: MoEConfig, x: torch.Tensor, params: dict[str, torch.Tensor], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's output for x [B, T, D], and the routed expert ids [B, T, k]."""
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    prefix = f"model.layers.{layer}.{cfg.block}."
    ids, weights = route(cfg, flat, params, prefix)
    out = torch.zeros_like(flat)
    g, u, dn = cfg.expert_names
    # Experts in index order, each over the tokens routed to it (how transformers sums them).
    for e in torch.unique(ids).tolist():
        rows, which = torch.where(ids == e)
        p = f"{prefix}experts.{e}."
        y = swiglu(
            flat[rows], params[p + g + ".weight"], params[p + u + ".weight"], params[p + dn + ".weight"]
        )
        out.index_add_(0, rows, y * weights[rows, which, None].to(y.dtype))
    if cfg.shared_ffn:
        s = prefix + cfg.shared_prefix() + "."
        shared = swiglu(
            flat, params[s + "gate_proj.weight"], params[s + "up_proj.weight"], params[s + "down_proj.weight"]
        )
        if cfg.shared_gate:
            shared = torch.sigmoid(F.linear(flat, params[prefix + "shared_expert_gate.weight"])) * shared
        out = out + shared
    return out.view(b, t, d), ids.view(b, t, cfg.top_k)

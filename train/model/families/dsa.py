"""DeepSeek sparse attention (DSA): GLM-5 (HF model_type `glm_moe_dsa`) and DeepSeek-V3.2
(`deepseek_v32`) in megatron-core 0.16 through mbridge's DeepSeek-V3 bridge.

Both are DeepSeek-V3's decoder (multi-latent attention, its router and experts) whose attention lets
each query see only the keys an *indexer* picks (transformers' GlmMoeDsaIndexer / DeepseekV32Indexer):

    q = wq_b(q_a_layernorm(q_a_proj(x)))          [heads_i, d_i]   (the MLA's normalized q latent)
    k = k_norm(wk(x))                               [d_i]            (LayerNorm with bias, eps 1e-6)
    RoPE on qk_rope_head_dim of each (interleaved pairs for GLM-5, halves for DeepSeek-V3.2)
    score(s, t) = sum_h weights_proj(x)_h / sqrt(heads_i) * relu(q_h . k_t) / sqrt(d_i)
    keys(s) = top index_topk of score(s, .) among the keys s may see (causal, not padding)

The indexer has no gradient path (transformers runs it under no_grad; slime feeds it detached inputs):
its choice only masks the MLA's attention. GLM-5.2's `indexer_types` make some layers "shared": they
have no indexer and reuse the choice of the latest computing layer before them.

Here (`sparse_attention_class`): Megatron's MLASelfAttention with the indexer's four modules under
slime's names (`self_attention.wq_b.weight`, `wk`, `k_norm.{weight,bias}`, `weights_proj`; slime's
GLM-5 spec, so its torch_dist checkpoints load), replicated over TP (each rank computes the same
choice from the whole TP sequence). Its forward computes the choice, folds it into the attention mask
and runs Megatron's MLA forward with that mask, so recompute, sequence and context parallelism run as
for DeepSeek-V3. The core attention is Megatron's local one (masked softmax) under either spec: TE's
fused attention takes no arbitrary mask; memory is heads x s^2 per micro-batch (no sparse kernel).

Layout: slime's Megatron layout keeps each indexer head as [no-RoPE dims, RoPE dims] (HF: RoPE first);
the bridge (`dsa_bridge_class`) moves the RoPE rows of wq_b, wk and k_norm across on conversion.

A shared layer finds its source's choice in a `ChoiceBook` per model chunk, keyed by the attention
mask's storage: Megatron's activation recompute hands layers a detached copy of the mask (a new tensor
on the same storage), so the key survives recompute, and the book keeps the choices of the latest
masks only (those of micro-batches still in flight).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.parallel import context

_CLASSES: dict[str, type] = {}
INDEXER_MODULES = ("wq_b", "wk", "k_norm", "weights_proj")
# Query rows scored at once: bounds the [b, rows, heads_i, s] score block (the choice is per row).
_ROWS_PER_BLOCK = 1024


@dataclass(frozen=True)
class SparseIndexer:
    """The indexer's shape (from the HF config: hf_config.ModelArch's index_* fields)."""

    heads: int
    head_dim: int
    topk: int
    rope_interleaved: bool
    shared: tuple[bool, ...]
    """Per layer (0-based) True where the layer reuses the latest computing layer's choice."""

    def source(self, layer_number: int) -> int:
        """The computing layer (1-based, Megatron's layer_number) whose choice layer `layer_number` uses."""
        layer = layer_number
        while self.shared[layer - 1]:
            layer -= 1
        return layer

    @classmethod
    def of(cls, arch: Any) -> SparseIndexer | None:
        if arch.index_heads is None:
            return None
        return cls(
            heads=arch.index_heads,
            head_dim=arch.index_head_dim,
            topk=arch.index_topk,
            rope_interleaved=arch.index_rope_interleaved,
            shared=tuple(arch.index_shared),
        )


class ChoiceBook:
    """Each computing layer's chosen keys per micro-batch, for the shared layers after it (module doc)."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._by_mask: collections.OrderedDict[tuple[Any, ...], dict[int, torch.Tensor]] = (
            collections.OrderedDict()
        )

    @staticmethod
    def _key(mask: torch.Tensor) -> tuple[Any, ...]:
        return (mask.device, mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()))

    def put(self, mask: torch.Tensor, layer: int, chosen: torch.Tensor) -> None:
        key = self._key(mask)
        choices = self._by_mask.pop(key, {})
        choices[layer] = chosen
        self._by_mask[key] = choices
        while len(self._by_mask) > self._keep:
            self._by_mask.popitem(last=False)

    def get(self, mask: torch.Tensor, layer: int, asking: int) -> torch.Tensor:
        chosen = self._by_mask.get(self._key(mask), {}).get(layer)
        if chosen is None:
            raise RuntimeError(
                f"sparse attention: layer {asking} reuses layer {layer}'s chosen keys, which did not run "
                "in this forward on this pipeline stage (every stage must start with a computing layer)"
            )
        return chosen


def check_stage_starts(
    indexer: SparseIndexer, first_layer: int, flag: str = "--pipeline-model-parallel-size"
) -> None:
    """A pipeline stage whose first layer (1-based) is shared would need the previous stage's choice."""
    if indexer.shared[first_layer - 1]:
        raise ValueError(
            f"{flag}: the pipeline stage starting at layer {first_layer} would begin with a layer that "
            f"reuses layer {indexer.source(first_layer)}'s chosen keys from the previous stage; choose a "
            "split where every stage starts with a computing layer (HF indexer_types 'full')"
        )


def _rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float) -> torch.Tensor:
    """RoPE over all of `t`'s last dim: interleaved pairs (GLM-5) or halves (DeepSeek-V3.2).
    Megatron's MLA rotation de-interleaves first, which is the pairs' rotation in another order of
    dims; the indexer only takes dot products of q and k rotated alike, so the order is immaterial."""
    with quiet_megatron_imports():
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    out: torch.Tensor = _apply_rotary_pos_emb_bshd(
        t, freqs, rotary_interleaved=False, multi_latent_attention=interleaved, mscale=mscale
    )
    return out


class LayoutRotary(torch.nn.Module):
    """MLA's rotary embedding answering for this CP rank's positions in tether's layout
    (`context.CPLayout.positions`: Megatron's load-balanced chunks, or --allgather-cp's contiguous
    shares), where Megatron's slices for its own chunks only."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get_rotary_seq_len(*args, **kwargs)  # type: ignore[operator]

    def whole(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """The angles of positions 0..seq_len-1 ([seq_len, 1, 1, dims]) and YaRN's scale (1 without)."""
        out = self.inner(seq_len, packed_seq=True)  # packed_seq: not sliced for CP
        if isinstance(out, tuple):
            return out[0], float(out[1])
        return out, 1.0

    def forward(self, seq_len: int, packed_seq: bool = False) -> Any:
        layout = context.current()
        if packed_seq or layout.size == 1:
            return self.inner(seq_len, packed_seq=packed_seq)
        out = self.inner(seq_len, packed_seq=True)
        emb = out[0] if isinstance(out, tuple) else out
        mine = emb.index_select(0, layout.positions(seq_len, emb.device))
        return (mine, out[1]) if isinstance(out, tuple) else mine


def sparse_attention_class() -> type:
    """`SparseMLASelfAttention`, defined on first use (megatron is imported only on trainer ranks)."""
    if "attention" in _CLASSES:
        return _CLASSES["attention"]
    with quiet_megatron_imports():
        from megatron.core.tensor_parallel.mappings import (
            gather_from_sequence_parallel_region,
            gather_from_tensor_model_parallel_region,
        )
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class SparseMLASelfAttention(MLASelfAttention):  # type: ignore[misc]
        """Megatron's MLA self-attention masked to the keys DSA's indexer chooses (module doc)."""

        def __init__(
            self,
            config: Any,
            submodules: Any,
            layer_number: int,
            attn_mask_type: Any = AttnMaskType.padding,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
            *,
            indexer: SparseIndexer,
            book: ChoiceBook,
        ) -> None:
            super().__init__(
                config,
                submodules,
                layer_number,
                attn_mask_type=attn_mask_type,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            self.rotary_pos_emb = LayoutRotary(self.rotary_pos_emb)  # type: ignore[has-type]
            self.indexer = indexer
            self.book = book
            self.shares = indexer.shared[layer_number - 1]
            if self.shares:
                return
            device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
            made = {"dtype": config.params_dtype, "device": device}
            width = indexer.heads * indexer.head_dim
            self.wq_b = torch.nn.Linear(config.q_lora_rank, width, bias=False, **made)
            self.wk = torch.nn.Linear(config.hidden_size, indexer.head_dim, bias=False, **made)
            self.k_norm = torch.nn.LayerNorm(indexer.head_dim, eps=1e-6, **made)
            self.weights_proj = torch.nn.Linear(config.hidden_size, indexer.heads, bias=False, **made)

        def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> Any:
            mask = self.sparse_mask(hidden_states, attention_mask)
            return super().forward(hidden_states, mask, **kwargs)

        @torch.no_grad()
        def sparse_mask(
            self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
        ) -> torch.Tensor:
            """The attention mask (True: may not attend) with every key the indexer did not choose."""
            layout = context.current()
            local = hidden_states.shape[0] * (self._tp_size() if self._sequence_parallel() else 1)
            total = local * layout.size
            pos = layout.positions(total, hidden_states.device)
            if attention_mask is None:
                attention_mask = context.local_causal_mask(pos, total)
            if self.shares:
                source = self.indexer.source(self.layer_number)
                chosen = self.book.get(attention_mask, source, self.layer_number)
            else:
                chosen = self._choose(hidden_states, attention_mask, pos, total, layout)
                self.book.put(attention_mask, self.layer_number, chosen)
            keep = torch.zeros(
                (chosen.shape[0], chosen.shape[1], total), dtype=torch.bool, device=chosen.device
            )
            keep.scatter_(-1, chosen, True)
            return attention_mask | ~keep[:, None]

        def _tp_size(self) -> int:
            return int(self.pg_collection.tp.size())

        def _sequence_parallel(self) -> bool:
            return bool(self.config.sequence_parallel) and self._tp_size() > 1

        def _inputs(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(x, the normalized q latent), each over this CP rank's whole sequence (SP gathered)."""
            tp = self.pg_collection.tp
            q, _ = self.linear_q_down_proj(hidden_states)
            if q.size(-1) != self.config.q_lora_rank:  # column-parallel: the TP shards of q's dims
                q = gather_from_tensor_model_parallel_region(q, group=tp)
            elif self._sequence_parallel():
                q = gather_from_sequence_parallel_region(q, group=tp)
            x = (
                gather_from_sequence_parallel_region(hidden_states, group=tp)
                if self._sequence_parallel()
                else hidden_states
            )
            norm_weight = getattr(self.linear_q_up_proj, "layer_norm_weight", None)
            if norm_weight is not None and isinstance(self.q_layernorm, IdentityOp):
                # TransformerEngine's spec fuses q's norm into linear_q_up_proj.
                weight = norm_weight.float() + (1.0 if self.config.layernorm_zero_centered_gamma else 0.0)
                normed = torch.nn.functional.rms_norm(
                    q.float(), (q.shape[-1],), weight=weight, eps=self.config.layernorm_epsilon
                )
                return x, normed.to(q.dtype)
            return x, self.q_layernorm(q)

        def _choose(
            self,
            hidden_states: torch.Tensor,
            attention_mask: torch.Tensor,
            pos: torch.Tensor,
            total: int,
            layout: context.CPLayout,
        ) -> torch.Tensor:
            """int64 [b, this rank's queries, k]: the keys (global positions) each query attends to."""
            ix = self.indexer
            rope_dims = int(self.config.qk_pos_emb_head_dim)
            plain = ix.head_dim - rope_dims
            x, q_latent = self._inputs(hidden_states)
            s, b = x.shape[:2]
            freqs, mscale = self.rotary_pos_emb.whole(total)
            q = self.wq_b(q_latent).view(s, b, ix.heads, ix.head_dim)
            q_rot = _rope(q[..., plain:], freqs.index_select(0, pos), ix.rope_interleaved, mscale)
            q = torch.cat([q[..., :plain], q_rot], dim=-1)
            k = self.k_norm(self.wk(x))  # [s, b, d_i]
            k = context.gather_sequence(k, 0, layout)
            k_rot = _rope(k[..., plain:], freqs[:, 0], ix.rope_interleaved, mscale)
            k = torch.cat([k[..., :plain], k_rot], dim=-1).float()
            weights = self.weights_proj(x).float() * ix.heads**-0.5  # [s, b, heads_i]
            blocked = attention_mask[:, 0].expand(b, s, total)
            topk = min(ix.topk, total)
            chosen = []
            for start in range(0, s, _ROWS_PER_BLOCK):
                rows = slice(start, min(start + _ROWS_PER_BLOCK, s))
                scores = torch.einsum("sbhd,tbd->bsht", q[rows].float(), k).relu_() * ix.head_dim**-0.5
                index = torch.einsum("sbh,bsht->bst", weights[rows], scores)
                index = index.masked_fill(blocked[:, rows], float("-inf"))
                chosen.append(index.topk(topk, dim=-1).indices)
            return torch.cat(chosen, dim=1)

    _CLASSES["attention"] = SparseMLASelfAttention
    return SparseMLASelfAttention


def with_sparse_attention(block: Any, indexer: SparseIndexer, *, context_parallel: bool) -> Any:
    """The block spec `block` with every layer's MLA self-attention the sparse one (one `ChoiceBook`
    for the chunk) and its core attention Megatron's local masked attention (`spec`)."""
    with quiet_megatron_imports():
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from tether.train.model.spec import mla_core_attention

    cls = sparse_attention_class()
    book = ChoiceBook()
    core = mla_core_attention(context_parallel=context_parallel)
    layers = []
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is not MLASelfAttention:
            raise ValueError(f"sparse attention replaces MLASelfAttention, not {attention.module}")
        sparse = dataclasses.replace(
            attention,
            module=cls,
            params={**attention.params, "indexer": indexer, "book": book},
            submodules=dataclasses.replace(attention.submodules, core_attention=core),
        )
        submodules = dataclasses.replace(spec.submodules, self_attention=sparse)
        layers.append(dataclasses.replace(spec, submodules=submodules))
    return dataclasses.replace(block, layer_specs=layers)


def wants_mask(model: Any) -> bool:
    """Whether `model` (a chunk, wrapped or not) has sparse attention, which needs an explicit
    attention mask per micro-batch (its `ChoiceBook` key), never Megatron's implicit causal one."""
    while model is not None:
        if getattr(model, "tether_sparse_attention", False):
            return True
        model = getattr(model, "module", None)
    return False


def is_indexer_parameter(name: str) -> bool:
    """Whether parameter `name` is an indexer's (slime's `_is_indexer_parameter`: one of the indexer's
    modules directly under `self_attention`, or under Megatron's own DSA `core_attention.indexer`)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part != "self_attention":
            continue
        nxt = parts[i + 1]
        if nxt in INDEXER_MODULES:
            return True
        if nxt == "core_attention" and i + 2 < len(parts) and parts[i + 2] == "indexer":
            return True
    return False


def freeze_indexers(model: Any) -> list[str]:
    """--freeze-indexer: the indexer's weights take no optimizer step (no weight decay either, which
    with no gradient is all an unfrozen indexer gets); refused where a chunk with attention has none."""
    frozen = []
    attention = False
    for name, param in model.named_parameters():
        attention |= "self_attention" in name.split(".")
        if is_indexer_parameter(name):
            param.requires_grad = False
            frozen.append(name)
    if attention and not frozen:
        raise ValueError(
            "--freeze-indexer: this model chunk has attention layers but no DeepSeek sparse-attention "
            "indexer (GLM-5 glm_moe_dsa / DeepSeek-V3.2 deepseek_v32 have one)"
        )
    return frozen


# HF indexer tensors whose rows hold each head's RoPE dims first (HF) or last (Megatron, slime).
_ROTATED = ("self_attention.wq_b.weight", "self_attention.wk.weight", "self_attention.k_norm.")


def _rope_rows(tensor: torch.Tensor, head_dim: int, rope_dims: int, to_mcore: bool) -> torch.Tensor:
    """Each head's rows [rope, rest] (HF) as [rest, rope] (Megatron), or back."""
    heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
    cut = rope_dims if to_mcore else head_dim - rope_dims
    return torch.cat([heads[:, cut:], heads[:, :cut]], dim=1).reshape(tensor.shape)


def dsa_bridge_class() -> type:
    """mbridge's DeepSeek-V3 bridge with the indexer's tensors (module doc: their RoPE rows move)."""
    if "bridge" in _CLASSES:
        return _CLASSES["bridge"]
    with quiet_megatron_imports():
        from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    indexer = "model.layers.{layer_number}.self_attn.indexer."

    class DSABridge(DeepseekV3Bridge):  # type: ignore[misc]
        """GLM-5 / DeepSeek-V3.2: DeepSeek-V3's names plus `self_attn.indexer.*`."""

        # mbridge takes the first key contained in the Megatron name: the indexer's first.
        _ATTENTION_MAPPING: ClassVar[dict[str, list[str]]] = {
            "self_attention.wq_b.weight": [indexer + "wq_b.weight"],
            "self_attention.wk.weight": [indexer + "wk.weight"],
            "self_attention.k_norm.weight": [indexer + "k_norm.weight"],
            "self_attention.k_norm.bias": [indexer + "k_norm.bias"],
            "self_attention.weights_proj.weight": [indexer + "weights_proj.weight"],
            **DeepseekV3Bridge._ATTENTION_MAPPING,
        }

        def _rope_layout(self, name: str, tensor: torch.Tensor, to_mcore: bool) -> torch.Tensor:
            if not any(part in name for part in _ROTATED):
                return tensor
            hf = self.hf_config
            return _rope_rows(tensor, int(hf.index_head_dim), int(hf.qk_rope_head_dim), to_mcore)

        def _weight_to_mcore_format(self, name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
            if any(part in name for part in _ROTATED):
                return self._rope_layout(name, hf_weights[0].to(self.dtype), to_mcore=True)
            return super()._weight_to_mcore_format(name, hf_weights)

        def _weight_to_hf_format(
            self, name: str, weights: torch.Tensor
        ) -> tuple[list[str], list[torch.Tensor]]:
            if any(part in name for part in _ROTATED):
                return self._weight_name_mapping_mcore_to_hf(name), [
                    self._rope_layout(name, weights, to_mcore=False)
                ]
            return super()._weight_to_hf_format(name, weights)

    _CLASSES["bridge"] = DSABridge
    return DSABridge

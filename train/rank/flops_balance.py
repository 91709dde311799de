"""--balance-by-flops: each sample's estimated forward FLOPs, and a step's micro-batches and data-parallel
shards balanced on them with Karmarkar–Karp's largest differencing method (slime's schedule for the flag).

The estimate is slime's (slime/utils/flops_utils.py): per layer the Q/K/V projections, causal
attention's two L x L products, an h x h output projection and a SwiGLU MLP (MoE layers: top-k
experts plus the shared one), and the output layer. Only attention grows with L², so a sample's cost
is `linear * L + quadratic * L²` (`FlopsModel`).

The schedule packs first and distributes second, as slime's `build_dp_schedule` does with the flag:

1. ceil(step tokens / --max-tokens-per-gpu) micro-batches (one per sample when that is at least the
   sample count), filled by Karmarkar–Karp on the samples' FLOPs. The token cap is not enforced: a
   micro-batch may hold more tokens than it (slime's warning: this may run out of memory).
2. The count rounded up to a multiple of DP by splitting the micro-batch with the most tokens
   (of those with two samples or more) into two token-balanced halves, as often as needed.
3. The micro-batches dealt to the DP ranks by Karmarkar–Karp on their FLOPs, the same number each
   (every rank runs as many micro-batches; no filler sample is needed).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import msgspec

from tether.train.model.hf_config import ModelArch


class FlopsModel(msgspec.Struct, frozen=True, kw_only=True):
    """A sequence of L tokens costs `linear * L + quadratic * L**2` forward FLOPs (slime's estimate)."""

    linear: int
    quadratic: int

    def of(self, length: int) -> int:
        return self.linear * length + self.quadratic * length * length


def flops_model(arch: ModelArch) -> FlopsModel:
    """slime's `calculate_fwd_flops` for this architecture, as per-token and per-token² coefficients."""
    h, heads, groups, kv = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    if arch.multi_latent_attention:
        assert arch.qk_head_dim is not None and arch.qk_pos_emb_head_dim is not None
        assert arch.v_head_dim is not None
        qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        if arch.q_lora_rank is not None:
            q = 2 * arch.q_lora_rank * (h + heads * qk)
        else:
            q = 2 * h * heads * qk
        if arch.kv_lora_rank is not None:
            kv_proj = 2 * (arch.kv_lora_rank * (h + heads * (arch.qk_head_dim + arch.v_head_dim)))
            kv_proj += 2 * h * arch.qk_pos_emb_head_dim
        else:
            kv_proj = 4 * h * groups * kv
        # causal Q K^T (half of 2 * heads * qk) and the full A V
        attention = heads * qk + heads * arch.v_head_dim
    else:
        q = 2 * h * heads * kv
        kv_proj = 4 * h * groups * kv
        attention = heads * kv + heads * kv
    # slime counts the output projection as h x h and every MLP as SwiGLU (three h x F matrices).
    per_layer = q + kv_proj + 2 * h * h

    def mlp(ffn: int) -> int:
        return 6 * h * ffn

    if arch.num_experts is None:
        dense, moe = arch.num_layers, 0
        moe_ffn = 0
    else:
        assert arch.moe_ffn_hidden_size is not None and arch.moe_router_topk is not None
        freq = arch.moe_layer_freq or (1,) * arch.num_layers
        moe = sum(1 for f in freq if f)
        dense = len(freq) - moe
        moe_ffn = arch.moe_ffn_hidden_size * arch.moe_router_topk + (
            arch.moe_shared_expert_intermediate_size or 0
        )
    linear = dense * (per_layer + mlp(arch.ffn_hidden_size)) + moe * (per_layer + mlp(moe_ffn))
    linear += 2 * h * arch.vocab_size  # the output layer (slime leaves the embedding out)
    return FlopsModel(linear=linear, quadratic=(dense + moe) * attention)


def karmarkar_karp(weights: Sequence[int], parts: int, *, equal_size: bool) -> list[list[int]]:
    """Item indices in `parts` groups of near-equal weight sums, by largest differencing.

    Every item starts as a partial solution of `parts` subsets (itself in one, the others empty; with
    `equal_size`, each run of `parts` consecutive items in weight order makes one solution, an item
    per subset, so all groups end the same size). The two solutions of largest spread (heaviest minus
    lightest subset) are merged, heaviest subset of one with the lightest of the other, until one
    is left. Each group's indices are ascending; groups come heaviest first. Positive weights and at
    least `parts` items (a multiple of it with `equal_size`) give no empty group.
    """
    n = len(weights)
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    if n < parts:
        raise ValueError(f"{n} items cannot fill {parts} groups")
    if equal_size and n % parts:
        raise ValueError(f"{n} items do not split into {parts} groups of equal size")
    order = sorted(range(n), key=lambda i: (int(weights[i]), i))
    # A partial solution: its subsets as (sum, indices), heaviest first.
    starts: list[list[tuple[int, list[int]]]] = []
    step = parts if equal_size else 1
    for at in range(0, n, step):
        subsets = [(int(weights[i]), [i]) for i in order[at : at + step]]
        subsets += [(0, []) for _ in range(parts - len(subsets))]
        starts.append(sorted(subsets, key=lambda s: -s[0]))
    counter = itertools.count()  # ties: the solution made first merges first (deterministic)
    heap = [(-(s[0][0] - s[-1][0]), -s[0][0], next(counter), s) for s in starts]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), -merged[0][0], next(counter), merged))
    groups = [sorted(indices) for _, indices in heap[0][3]]
    if any(not g for g in groups):
        raise ValueError("a group came out empty: weights must be positive")
    return groups


def _split_by_tokens(indices: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two halves of a micro-batch, longest sample first into the half with fewer tokens."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for i in sorted(indices, key=lambda i: (-int(lengths[i]), i)):
        side = 0 if sums[0] <= sums[1] else 1
        halves[side].append(i)
        sums[side] += int(lengths[i])
    return sorted(halves[0]), sorted(halves[1])


def flops_balanced_schedule(
    lengths: Sequence[int], dp_size: int, max_tokens_per_gpu: int, model: FlopsModel
) -> list[list[list[int]]]:
    """`schedule[rank][k]`: the sample indices (into `lengths`, one step's samples) of micro-batch k
    of that DP rank; every rank gets the same number. See the module docstring for the steps."""
    n = len(lengths)
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu={max_tokens_per_gpu} must be >= 1")
    if n < dp_size:
        raise ValueError(f"{n} samples cannot fill {dp_size} data-parallel ranks")
    work = [model.of(int(length)) for length in lengths]
    wanted = max(1, -(-sum(int(x) for x in lengths) // max_tokens_per_gpu))
    if wanted >= n:
        bins = [[i] for i in range(n)]
    else:
        bins = karmarkar_karp(work, wanted, equal_size=False)
    target = max(-(-len(bins) // dp_size) * dp_size, dp_size)
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            raise ValueError(
                f"--balance-by-flops: a step of {n} samples makes {len(bins)} micro-batches, which cannot "
                f"become a multiple of the {dp_size} data-parallel ranks (slime's rule: every rank runs "
                "as many micro-batches); raise --max-tokens-per-gpu or put more samples in each step"
            )
        big = max(splittable, key=lambda b: (sum(int(lengths[i]) for i in bins[b]), -b))
        bins[big], extra = _split_by_tokens(bins[big], lengths)
        bins.append(extra)
    bins.sort(key=lambda b: b[0])  # micro-batches in sample order (KK's order carries no meaning)
    per_rank = karmarkar_karp([sum(work[i] for i in b) for b in bins], dp_size, equal_size=True)
    return [[bins[k] for k in ks] for ks in per_rank]


__all__ = ["FlopsModel", "flops_balanced_schedule", "flops_model", "karmarkar_karp"]

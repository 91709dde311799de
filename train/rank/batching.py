"""The columnar train batch, its data-parallel shards and micro-batches, and the tensors a GPT forward needs.

One training step's samples travel as a `TrainBatch`: numpy columns (tokens concatenated with offsets;
per-response-token columns concatenated in sample order), which the RPC layer carries as raw frames.

Layout:
- `tokens[offsets[i]:offsets[i+1]]` are sample i's prompt + response tokens;
- per-response-token columns (`loss_masks`, `rollout_log_probs`, `advantages`, ...) are concatenated
  response slices: sample i owns `[response_offsets[i], response_offsets[i+1])`;
- per-sample columns (`rewards`, `rollout_ids`, `loss_weights`, ...) have one entry per sample;
- `routed_experts` (MoE routing replay, R3) is per token like `tokens`: row `offsets[i] + t` holds
  the experts the engine routed sample i's token t to in every layer; each sample's last token was
  never routed (the engine stops after sampling it) and holds UNROUTED.

`loss_weights[i]` is the weight of each trainable token of sample i in the step's loss: computed once
for the whole step (before sharding) so that a micro-batch's loss is the *sum* of token_loss x weight
and the sum over micro-batches and data-parallel ranks is exactly the step mean (see
`tether.train.algorithms.losses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from tether.rollout.sample import Sample, SampleContractError

UNROUTED = -1
"""routed_experts of a token no engine routed (tether.train.parallel.routing_replay fills in any experts)."""

if TYPE_CHECKING:
    import torch


class TrainBatch(msgspec.Struct, kw_only=True):
    """One step's (or one DP shard's) samples, columnar. See the module docstring for the layout."""

    tokens: np.ndarray
    """int32, every sample's tokens concatenated."""
    offsets: np.ndarray
    """int64 [n+1]: sample i spans tokens[offsets[i]:offsets[i+1]]."""
    response_lengths: np.ndarray
    """int32 [n]."""
    loss_masks: np.ndarray
    """uint8 [sum(response_lengths)]."""
    rewards: np.ndarray
    """float32 [n]: the reward the estimator uses (group-normalised where the estimator says so)."""
    raw_rewards: np.ndarray
    """float32 [n]: the reward as the verifier gave it (for metrics)."""
    rollout_ids: np.ndarray
    """int64 [n]: segments of one agent execution share a rollout id (the per-rollout denominator)."""
    sample_indices: np.ndarray
    """int64 [n]: Sample.index (-1 where unset)."""
    group_indices: np.ndarray
    """int64 [n]: Sample.group_index (-1 where unset)."""
    loss_weights: np.ndarray
    """float64 [n]: weight of each trainable token of the sample in the step loss (0 for filler)."""
    rollout_log_probs: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the engine's log-probs."""
    advantages: np.ndarray | None = None
    """float32 [sum(response_lengths)]: filled on the trainer (tether.train.algorithms.advantages)."""
    old_log_probs: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the trainer's log-probs before the step."""
    ref_log_probs: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the reference model's log-probs."""
    teacher_log_probs: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the on-policy distillation teacher's log-probs (--use-opd):
    from the Samples (--opd-type sglang) or the trainer's teacher model (--opd-type megatron)."""
    routed_experts: np.ndarray | None = None
    """int32 [num_tokens, layers, topk]: the experts the rollout engine routed each token to
    (--use-rollout-routing-replay); UNROUTED (-1) on each sample's last token."""
    values: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the critic's values before its step (ppo)."""
    returns: np.ndarray | None = None
    """float32 [sum(response_lengths)]: the critic's GAE returns, its value-loss target (ppo)."""
    positions: np.ndarray | None = None
    """int64 [n]: each sample's position in its rollout's batch, slime's `partition` (set where
    a rollout's steps are cut, `tether.train.rank.work.rollout_steps`; `select` carries it)."""

    def rollout_positions(self) -> np.ndarray:
        """`positions`, or each sample's own index where the batch is a whole rollout's."""
        return np.arange(self.num_samples, dtype=np.int64) if self.positions is None else self.positions

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def total_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def response_offsets(self) -> np.ndarray:
        out = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(self.response_lengths, out=out[1:])
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_trainable_tokens(self) -> int:
        return int(self.loss_masks.sum(dtype=np.int64))

    def trainable_per_sample(self) -> np.ndarray:
        """int64 [n]: trainable (loss_mask == 1) token count of each sample."""
        ro = self.response_offsets
        csum = np.concatenate([[0], np.cumsum(self.loss_masks, dtype=np.int64)])
        return csum[ro[1:]] - csum[ro[:-1]]

    def sample_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def select(
        self, indices: Sequence[int] | np.ndarray, *, filler: Sequence[bool] | None = None
    ) -> TrainBatch:
        """A new batch of the given samples, in the given order.

        `filler[k]` marks a copy whose loss mask and weight are zeroed: it exists only so every
        data-parallel rank runs the same number of micro-batches (collectives stay in step).
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample index out of range 0..{self.num_samples - 1}: {idx.tolist()}")
        ro = self.response_offsets

        def gather(col: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
            if idx.size == 0:
                return col[:0].copy()
            return np.concatenate([col[s:e] for s, e in zip(starts[idx], ends[idx], strict=True)])

        def per_token(col: np.ndarray | None) -> np.ndarray | None:
            return None if col is None else gather(col, ro[:-1], ro[1:])

        lengths = self.total_lengths[idx]
        offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        loss_masks = gather(self.loss_masks, ro[:-1], ro[1:])
        weights = self.loss_weights[idx].copy()
        if filler is not None:
            fill = np.asarray(filler, dtype=bool)
            if fill.shape != idx.shape:
                raise ValueError(f"filler has {fill.size} entries for {idx.size} indices")
            weights[fill] = 0.0
            new_ro = np.zeros(idx.size + 1, dtype=np.int64)
            np.cumsum(self.response_lengths[idx], out=new_ro[1:])
            for k in np.flatnonzero(fill):
                loss_masks[new_ro[k] : new_ro[k + 1]] = 0
        return TrainBatch(
            tokens=gather(self.tokens, self.offsets[:-1], self.offsets[1:]),
            offsets=offsets,
            response_lengths=self.response_lengths[idx].copy(),
            loss_masks=loss_masks,
            rewards=self.rewards[idx].copy(),
            raw_rewards=self.raw_rewards[idx].copy(),
            rollout_ids=self.rollout_ids[idx].copy(),
            sample_indices=self.sample_indices[idx].copy(),
            group_indices=self.group_indices[idx].copy(),
            loss_weights=weights,
            rollout_log_probs=per_token(self.rollout_log_probs),
            advantages=per_token(self.advantages),
            old_log_probs=per_token(self.old_log_probs),
            ref_log_probs=per_token(self.ref_log_probs),
            teacher_log_probs=per_token(self.teacher_log_probs),
            values=per_token(self.values),
            returns=per_token(self.returns),
            routed_experts=None
            if self.routed_experts is None
            else gather(self.routed_experts, self.offsets[:-1], self.offsets[1:]),
            positions=None if self.positions is None else self.positions[idx].copy(),
        )

    def validate(self) -> None:
        """Check the columns agree with each other; raise ValueError naming the column."""
        n = self.num_samples
        if self.offsets.shape != (n + 1,) or self.offsets[0] != 0 or np.any(np.diff(self.offsets) <= 0):
            raise ValueError(
                f"offsets={self.offsets.tolist()[:8]}... must rise from 0 with one entry per sample + 1"
            )
        if int(self.offsets[-1]) != self.tokens.size:
            raise ValueError(
                f"tokens has {self.tokens.size} entries but offsets end at {int(self.offsets[-1])}"
            )
        if np.any(self.response_lengths <= 0) or np.any(self.response_lengths >= self.total_lengths):
            raise ValueError(
                "response_lengths must satisfy 0 < response_length < total length for every sample"
            )
        r = int(self.response_lengths.sum())
        per_token = ("loss_masks", "rollout_log_probs", "advantages", "old_log_probs", "ref_log_probs")
        for name in (*per_token, "values", "returns", "teacher_log_probs"):
            col = getattr(self, name)
            if col is not None and col.shape != (r,):
                raise ValueError(f"{name} has shape {col.shape}; expected ({r},) (one per response token)")
        for name in (
            "rewards",
            "raw_rewards",
            "rollout_ids",
            "sample_indices",
            "group_indices",
            "loss_weights",
            "positions",
        ):
            col = getattr(self, name)
            if col is not None and col.shape != (n,):
                raise ValueError(f"{name} has shape {col.shape}; expected ({n},) (one per sample)")
        routed = self.routed_experts
        if routed is not None and (routed.ndim != 3 or routed.shape[0] != self.tokens.size):
            raise ValueError(
                f"routed_experts has shape {routed.shape}; expected ({self.tokens.size}, layers, topk) "
                "(one row per token)"
            )


def build_train_batch(
    samples: Sequence[Sample],
    *,
    rewards: Sequence[float] | np.ndarray,
    raw_rewards: Sequence[float] | np.ndarray | None = None,
    per_rollout_loss_mean: bool = False,
) -> TrainBatch:
    """The columnar batch of one training step, with the step's loss weights already computed.

    `rewards` are the values the estimator uses (see `tether.train.algorithms.advantages.process_rewards`).
    A sample whose `rollout_id` is unset gets a fresh id of its own (slime's rule).
    """
    n = len(samples)
    if n == 0:
        raise ValueError("a train batch needs at least one sample")
    if len(rewards) != n:
        raise ValueError(f"rewards has {len(rewards)} entries for {n} samples")
    lengths = np.empty(n, dtype=np.int64)
    resp = np.empty(n, dtype=np.int32)
    for i, s in enumerate(samples):
        lengths[i] = len(s.tokens)
        resp[i] = s.response_length
        if not 0 < s.response_length < len(s.tokens):
            raise SampleContractError(
                "response_length",
                s.response_length,
                f"must satisfy 0 < it < len(tokens)={len(s.tokens)}",
                sample_index=s.index,
            )
        if s.loss_mask is not None and len(s.loss_mask) != s.response_length:
            raise SampleContractError(
                "loss_mask",
                len(s.loss_mask),
                f"entries for response_length={s.response_length}",
                sample_index=s.index,
            )
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for s in samples for t in s.tokens), dtype=np.int32, count=int(offsets[-1]))
    masks = np.fromiter(
        (m for s in samples for m in (s.loss_mask if s.loss_mask is not None else [1] * s.response_length)),
        dtype=np.uint8,
        count=int(resp.sum()),
    )
    rollout_log_probs = _response_column(samples, "rollout_log_probs", int(resp.sum()))
    routed_experts = _routed_experts(samples, lengths)
    # on-policy distillation's teacher log-probs, where the samples carry them
    teacher_log_probs = _response_column(samples, "teacher_log_probs", int(resp.sum()))
    used = {s.rollout_id for s in samples if s.rollout_id is not None}
    fresh = 0
    rollout_ids = np.empty(n, dtype=np.int64)
    for i, s in enumerate(samples):
        if s.rollout_id is None:
            while fresh in used:
                fresh += 1
            used.add(fresh)
            rollout_ids[i] = fresh
        else:
            rollout_ids[i] = s.rollout_id
    rewards_arr = np.asarray(rewards, dtype=np.float32)
    batch = TrainBatch(
        tokens=tokens,
        offsets=offsets,
        response_lengths=resp,
        loss_masks=masks,
        rewards=rewards_arr,
        raw_rewards=rewards_arr.copy() if raw_rewards is None else np.asarray(raw_rewards, dtype=np.float32),
        rollout_ids=rollout_ids,
        sample_indices=np.array([-1 if s.index is None else s.index for s in samples], dtype=np.int64),
        group_indices=np.array(
            [-1 if s.group_index is None else s.group_index for s in samples], dtype=np.int64
        ),
        loss_weights=np.zeros(n, dtype=np.float64),
        rollout_log_probs=rollout_log_probs,
        teacher_log_probs=teacher_log_probs,
        routed_experts=routed_experts,
    )
    batch.loss_weights = step_loss_weights(batch, per_rollout_loss_mean=per_rollout_loss_mean)
    batch.validate()
    return batch


def _response_column(samples: Sequence[Sample], field: str, total: int) -> np.ndarray | None:
    """A per-response-token float field of the samples (rollout or teacher log-probs) as one column,
    or None when no sample has it; if any sample has it, every one must, one per response token."""
    values = [getattr(s, field) for s in samples]
    have = [v is not None for v in values]
    if not any(have):
        return None
    if not all(have):
        missing = [s.index for s, h in zip(samples, have, strict=True) if not h]
        raise SampleContractError(field, None, f"missing on samples {missing[:8]} but set on others")
    for s, v in zip(samples, values, strict=True):
        if len(v) != s.response_length:
            raise SampleContractError(
                field, len(v), f"entries for response_length={s.response_length}", sample_index=s.index
            )
    return np.fromiter((x for v in values for x in v), dtype=np.float32, count=total)


def _routed_experts(samples: Sequence[Sample], lengths: np.ndarray) -> np.ndarray | None:
    """The samples' routed experts as one per-token column (UNROUTED on each last token), or None
    when no sample has them; every sample must have them, in one [layers, topk] shape, if any does."""
    have = [s.rollout_routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        missing = [s.index for s, h in zip(samples, have, strict=True) if not h]
        raise SampleContractError(
            "rollout_routed_experts", None, f"missing on samples {missing[:8]} but set on others"
        )
    first = samples[0].rollout_routed_experts
    assert first is not None
    shape = (first.layers, first.topk)
    out = np.full((int(lengths.sum()), *shape), UNROUTED, dtype=np.int32)
    start = 0
    for s, length in zip(samples, lengths, strict=True):
        routed = s.rollout_routed_experts
        assert routed is not None
        if (routed.rows, routed.layers, routed.topk) != (int(length) - 1, *shape):
            raise SampleContractError(
                "rollout_routed_experts",
                f"[{routed.rows}, {routed.layers}, {routed.topk}]",
                f"must have shape [len(tokens)-1={int(length) - 1}, {shape[0]}, {shape[1]}] "
                "(the layers and top-k of the other samples)",
                sample_index=s.index,
            )
        out[start : start + int(length) - 1] = routed.array()
        start += int(length)
    return out


def step_loss_weights(batch: TrainBatch, *, per_rollout_loss_mean: bool) -> np.ndarray:
    """float64 [n]: the weight of each trainable token of each sample, for a step made of `batch`.

    Per-token mean (default): 1 / (trainable tokens of the whole step).
    Per-rollout mean: 1 / (number of rollouts x trainable tokens of that rollout), where a rollout's
    count sums every segment sharing its rollout_id, whichever micro-batch or DP rank it lands on.
    Must run on the whole step, before sharding: a shard-local count would be wrong.
    """
    trainable = batch.trainable_per_sample()
    if not per_rollout_loss_mean:
        total = int(trainable.sum())
        return np.full(batch.num_samples, 1.0 / total if total else 0.0, dtype=np.float64)
    ids, inverse = np.unique(batch.rollout_ids, return_inverse=True)
    per_rollout = np.bincount(inverse, weights=trainable, minlength=ids.size)
    # A rollout with no trainable token contributes nothing; it does not count among the rollouts.
    live = int((per_rollout > 0).sum())
    denom = per_rollout[inverse] * live
    return np.divide(1.0, denom, out=np.zeros(batch.num_samples, dtype=np.float64), where=denom > 0)


def split_steps(batch: TrainBatch, num_steps: int, *, per_rollout_loss_mean: bool) -> list[TrainBatch]:
    """Split one rollout's batch into `num_steps` optimizer steps, keeping every rollout_id in one step.

    Rollouts are assigned in order of first appearance, as evenly by count as they divide. Loss weights
    are recomputed per step (a step's mean is over that step's tokens or rollouts).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    order: dict[int, list[int]] = {}
    for i, rid in enumerate(batch.rollout_ids.tolist()):
        order.setdefault(rid, []).append(i)
    rollouts = list(order.values())
    if len(rollouts) < num_steps:
        raise ValueError(f"{len(rollouts)} rollouts cannot fill {num_steps} steps")
    bounds = np.linspace(0, len(rollouts), num_steps + 1).round().astype(int)
    steps = []
    for k in range(num_steps):
        idx = [i for r in rollouts[bounds[k] : bounds[k + 1]] for i in r]
        step = batch.select(idx)
        step.loss_weights = step_loss_weights(step, per_rollout_loss_mean=per_rollout_loss_mean)
        steps.append(step)
    return steps


def balanced_partition(
    weights: Sequence[int] | np.ndarray, parts: int, *, equal_size: bool = True
) -> list[list[int]]:
    """Split item indices into `parts` groups with near-equal weight sums (greedy LPT).

    Items go heaviest first (ties: lower index first) to the lightest eligible group (ties: lower
    group first), so the result is deterministic. With `equal_size`, group sizes differ by at most one.
    Each group's indices are returned in ascending order.
    """
    w = np.asarray(weights, dtype=np.int64)
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    low, extra = divmod(w.size, parts)  # with equal_size: `extra` groups hold low + 1 items, the rest low
    sums = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    at_high = 0
    for i in sorted(range(w.size), key=lambda i: (-int(w[i]), i)):
        best = -1
        for g in range(parts):
            size = len(groups[g])
            if equal_size and not (size < low or (size == low and at_high < extra)):
                continue
            if best < 0 or sums[g] < sums[best]:
                best = g
        groups[best].append(i)
        sums[best] += int(w[i])
        if equal_size and len(groups[best]) == low + 1:
            at_high += 1
    return [sorted(g) for g in groups]


def shard_for_data_parallel(batch: TrainBatch, dp_size: int, *, balance: bool = True) -> list[TrainBatch]:
    """DP shards with equal sample counts (filler copies where they differ).

    With `balance` (--balance-data) the shards' token counts are balanced (greedy LPT); without it
    the samples go round-robin, sample i to rank i mod dp_size (slime's default).
    Every shard gets the same number of samples so that, with a fixed micro-batch size, every rank runs
    the same number of micro-batches; a shard short by one gets a zero-weight copy of its shortest sample.
    The loss weights are the step's (computed before), so the shards' loss sums add to the step mean.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if batch.num_samples < dp_size:
        raise ValueError(f"{batch.num_samples} samples cannot fill {dp_size} data-parallel ranks")
    if balance:
        groups = balanced_partition(batch.total_lengths, dp_size, equal_size=True)
    else:
        groups = [list(range(rank, batch.num_samples, dp_size)) for rank in range(dp_size)]
    size = max(len(g) for g in groups)
    shards = []
    for g in groups:
        short = size - len(g)
        shortest = min(g, key=lambda i: (int(batch.total_lengths[i]), i))
        shards.append(batch.select(g + [shortest] * short, filler=[False] * len(g) + [True] * short))
    return shards


def plan_micro_batches(
    shards: Sequence[TrainBatch],
    *,
    micro_batch_size: int = 1,
    max_tokens_per_gpu: int | None = None,
) -> list[list[list[int]]]:
    """Micro-batches for each shard, the same number on every shard: `plan[rank][k]` = sample indices.

    Fixed size (`micro_batch_size`) when `max_tokens_per_gpu` is None; otherwise dynamic: as few
    micro-batches as hold every shard's samples within `max_tokens_per_gpu` tokens (first-fit on the
    longest first), then every shard is split into that many token-balanced micro-batches.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    if max_tokens_per_gpu is None:
        counts = {s.num_samples for s in shards}
        if len(counts) != 1:
            raise ValueError(f"shards hold different sample counts {sorted(counts)}; shard with filler first")
        n = counts.pop()
        return [
            [list(range(k, min(k + micro_batch_size, n))) for k in range(0, n, micro_batch_size)]
            for _ in shards
        ]
    if max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu={max_tokens_per_gpu} must be >= 1")
    need = 1
    for s in shards:
        lengths = s.total_lengths
        too_long = np.flatnonzero(lengths > max_tokens_per_gpu)
        if too_long.size:
            raise ValueError(
                f"a sample of {int(lengths[too_long[0]])} tokens exceeds --max-tokens-per-gpu={max_tokens_per_gpu}"
            )
        need = max(need, len(_first_fit(lengths, max_tokens_per_gpu)))
    plans = []
    for s in shards:
        if s.num_samples < need:
            raise ValueError(
                f"a shard of {s.num_samples} samples cannot form the {need} micro-batches other shards need; "
                "raise --max-tokens-per-gpu or use more samples per step"
            )
        plans.append(_split_exactly(s.total_lengths, need, max_tokens_per_gpu))
    return plans


def _first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(lengths.size), key=lambda i: (-int(lengths[i]), i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= int(lengths[i])
                break
        else:
            bins.append([i])
            room.append(capacity - int(lengths[i]))
    return bins


def _split_exactly(lengths: np.ndarray, k: int, capacity: int) -> list[list[int]]:
    """Exactly k non-empty micro-batches: token-balanced LPT, which keeps each within `capacity` when
    first-fit needed k or fewer on this shard; otherwise fall back to first-fit and split the biggest."""
    groups = balanced_partition(lengths, k, equal_size=False)
    if all(g for g in groups) and all(int(lengths[g].sum()) <= capacity for g in groups):
        return groups
    bins = [sorted(b) for b in _first_fit(lengths, capacity)]
    while len(bins) < k:
        bins.sort(key=lambda b: (-len(b), b[0]))
        big = bins.pop(0)
        bins += [big[: len(big) // 2], big[len(big) // 2 :]]
    return sorted(bins, key=lambda b: b[0])


@dataclass(frozen=True)
class MicroBatchTensors:
    """A micro-batch as a GPT forward and the loss need it (padded layout, [b, s]).

    Logits at position t predict token t+1. `response_index` lists, for every response token of every
    sample in order, the flat position (row * s + t) of the logits that predict it, so that
    `logits.view(b*s, v)[response_index]` lines up with every per-token tensor below.
    """

    tokens: torch.Tensor  # int64 [b, s], padded with 0
    position_ids: torch.Tensor  # int64 [b, s]
    attention_mask: torch.Tensor  # bool [b, 1, s, s], True where attention is NOT allowed (Megatron)
    response_index: torch.Tensor  # int64 [N]
    targets: torch.Tensor  # int64 [N]: the response tokens
    loss_mask: torch.Tensor  # float32 [N]
    token_weight: torch.Tensor  # float64 -> float32 [N]: the step-level weight of each token (0 if masked)
    response_lengths: list[int]
    rollout_log_probs: torch.Tensor | None
    advantages: torch.Tensor | None
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    num_tokens: int  # real (unpadded) tokens
    routed_experts: torch.Tensor | None = None  # int32 [s, b, layers, topk]: the router's token order
    values: torch.Tensor | None = None  # the critic's values before the step (ppo)
    returns: torch.Tensor | None = None  # the critic's value targets (ppo)
    total_lengths: list[int] | None = None  # each sample's prompt + response length
    # Context parallelism (tether.train.parallel.context.localize): the places among the N response
    # tokens of those this CP rank predicts, which `response_index` and `targets` then list alone.
    cp_which: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatchTensors:
        def mv(t: Any) -> Any:
            return t.to(device, non_blocking=True) if t is not None and hasattr(t, "to") else t

        return MicroBatchTensors(**{k: mv(v) for k, v in self.__dict__.items()})


def micro_batch_tensors(
    batch: TrainBatch,
    indices: Sequence[int] | None = None,
    *,
    pad_to_multiple_of: int = 1,
    min_shape: tuple[int, int] = (0, 0),
) -> MicroBatchTensors:
    """Padded tensors for the samples `indices` of `batch` (all of them when None).

    The sequence dimension is padded to a multiple of `pad_to_multiple_of` (TP under sequence
    parallelism, which splits the sequence over the TP ranks). `min_shape` (rows, positions): pad to
    at least that many rows (filler rows of padding only: no token of theirs is attended to or
    trained) and positions — the shape other ranks' micro-batches have where Megatron needs them
    equal (`common_micro_batch_shapes`).
    """
    import torch

    mb = batch if indices is None else batch.select(indices)
    real = mb.num_samples
    b = max(real, min_shape[0])
    lengths = np.zeros(b, dtype=np.int64)
    lengths[:real] = mb.total_lengths
    s = -(-max(int(lengths.max()), min_shape[1]) // pad_to_multiple_of) * pad_to_multiple_of
    tokens = np.zeros((b, s), dtype=np.int64)
    for i in range(real):
        tokens[i, : lengths[i]] = mb.sample_tokens(i)
    rows = []
    for i in range(real):
        prompt = int(lengths[i] - mb.response_lengths[i])
        rows.append(i * s + np.arange(prompt - 1, int(lengths[i]) - 1, dtype=np.int64))
    response_index = np.concatenate(rows)
    targets = tokens.reshape(-1)[response_index + 1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    pad = torch.from_numpy(np.arange(s)[None, :] >= lengths[:, None])  # [b, s] key padding
    attention_mask = causal[None, None, :, :] | pad[:, None, None, :]
    loss_mask = mb.loss_masks.astype(np.float32)
    token_weight = (np.repeat(mb.loss_weights, mb.response_lengths) * loss_mask).astype(np.float32)

    def opt(col: np.ndarray | None) -> torch.Tensor | None:
        return None if col is None else torch.from_numpy(np.ascontiguousarray(col, dtype=np.float32))

    routed = None
    if mb.routed_experts is not None:
        # [s, b, ...]: Megatron's routers see the hidden states sequence-first.
        table = np.full((s, b, *mb.routed_experts.shape[1:]), UNROUTED, dtype=np.int32)
        for i in range(real):
            table[: lengths[i], i] = mb.routed_experts[mb.offsets[i] : mb.offsets[i + 1]]
        routed = torch.from_numpy(table)

    return MicroBatchTensors(
        tokens=torch.from_numpy(tokens),
        position_ids=torch.arange(s, dtype=torch.int64).expand(b, s).contiguous(),
        attention_mask=attention_mask,
        response_index=torch.from_numpy(response_index),
        targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(loss_mask),
        token_weight=torch.from_numpy(token_weight),
        response_lengths=[int(x) for x in mb.response_lengths],
        rollout_log_probs=opt(mb.rollout_log_probs),
        advantages=opt(mb.advantages),
        old_log_probs=opt(mb.old_log_probs),
        ref_log_probs=opt(mb.ref_log_probs),
        num_tokens=int(lengths.sum()),
        routed_experts=routed,
        values=opt(mb.values),
        returns=opt(mb.returns),
        total_lengths=[int(x) for x in lengths[:real]],
    )


def packed_sequence_layout(batch: TrainBatch, indices: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The packed (THD) layout of the same samples: tokens [1, T], positions restarting per sample,
    `cu_seqlens` (int32 [n+1]) for Megatron's PackedSeqParams, and `response_index` into the T axis."""
    mb = batch if indices is None else batch.select(indices)
    lengths = mb.total_lengths
    starts = mb.offsets[:-1]
    positions = np.arange(mb.num_tokens, dtype=np.int64) - np.repeat(starts, lengths)
    index = np.concatenate(
        [
            np.arange(st + (ln - r) - 1, st + ln - 1, dtype=np.int64)
            for st, ln, r in zip(starts, lengths, mb.response_lengths, strict=True)
        ]
    )
    return {
        "tokens": mb.tokens.astype(np.int64)[None, :],
        "position_ids": positions[None, :],
        "cu_seqlens": mb.offsets.astype(np.int32),
        "response_index": index,
    }

"""slime's training-data dict in both directions, for two hooks (`tether.run.train_data_hooks` loads them):

    --custom-convert-samples-to-train-data-path   fn(args, samples) -> train_data
    --rollout-data-postprocess-path               fn(args, rollout_id, rollout_data)

`train_batch_from_train_data` builds the rollout's `TrainBatch` from what the converter returns, in
place of tether's conversion (and of the reward post-processing, which slime's converter replaces
too). Its keys are slime's `_convert_samples_to_train_data` ones, one entry per training sample:
`tokens` (prompt + response ids), `response_lengths`, `rewards` (what the advantage estimator uses),
`loss_masks` (one 0/1 per response token), and optionally `raw_reward` (default: rewards),
`rollout_ids` (default: one per sample), `sample_indices`, `rollout_log_probs` (one per response
token), `truncated` (not trained on) and `rollout_mask_sums` (checked against the loss masks).
Any other key is refused, naming it: tether would have to drop it.

`postprocess_step` calls the postprocess hook once per data-parallel shard, after the step's
log-prob passes and advantages (where slime's actor calls it, on each rank's rollout_data), with
slime's keys: `tokens`, `response_lengths`, `total_lengths`, `rewards`, `raw_reward` (the whole
rollout's, every rank gets it: slime ships it whole so hooks can reshape it into prompt groups),
`local_raw_reward` (the shard's, aligned with its other lists), `loss_masks`, `sample_indices`,
`rollout_ids`, `partition` (each sample's position in the rollout, its index in `raw_reward`, as
slime keeps it), and where the step has them `rollout_log_probs`,
`log_probs` (the trainer's, before the step), `ref_log_probs`, `advantages` and `returns` (equal to
the advantages: tether's estimators keep no separate returns). What the hook leaves in
`loss_masks`, `advantages`, `log_probs`, `ref_log_probs` and `rollout_log_probs` is what trains;
when it changed a loss mask, the step's loss weights are recomputed over every shard. Filler
copies (tether's padding for equal micro-batch counts across ranks) are not shown to the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tether.rollout.sample import Sample
from tether.train.rank.batching import TrainBatch, step_loss_weights

REQUIRED = ("tokens", "response_lengths", "rewards", "loss_masks")
OPTIONAL = (
    "raw_reward",
    "rollout_ids",
    "sample_indices",
    "rollout_log_probs",
    "truncated",
    "rollout_mask_sums",
)
TAKEN_BACK = ("loss_masks", "advantages", "log_probs", "ref_log_probs", "rollout_log_probs")
"""The postprocess hook's changes tether trains with."""


class TrainDataError(ValueError):
    """A hook's training data does not fit; names the hook's path and the key."""

    def __init__(self, path: str, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"hook {path}: {key}: {reason}")


def _host(value: Any) -> Any:
    """A tensor (any device) or array as a plain list; anything else as it is."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist() if hasattr(value, "tolist") else value


def _column(path: str, key: str, value: Any, n: int | None) -> list[Any]:
    items = _host(value)
    if not isinstance(items, list | tuple):
        raise TrainDataError(path, key, f"must be a list (one entry per sample), got {type(value).__name__}")
    if n is not None and len(items) != n:
        raise TrainDataError(path, key, f"has {len(items)} entries for {n} samples")
    return list(items)


def _per_token(path: str, key: str, value: Any, lengths: Sequence[int], dtype: Any) -> np.ndarray:
    rows = _column(path, key, value, len(lengths))
    parts = []
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        a = np.asarray(_host(row), dtype=dtype).reshape(-1)
        if a.shape[0] != n:
            raise TrainDataError(
                path, f"{key}[{i}]", f"has {a.shape[0]} values; response_lengths[{i}] is {n}"
            )
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise TrainDataError(path, f"{key}[{i}]", "holds a non-finite value")
        parts.append(a)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def train_batch_from_train_data(
    path: str, train_data: object, samples: Sequence[Sample], *, per_rollout_loss_mean: bool
) -> TrainBatch:
    """The rollout's TrainBatch from a converter's dict (see the module docstring); refuses, naming the
    key, what does not fit."""
    if not isinstance(train_data, Mapping):
        raise TrainDataError(
            path, "return value", f"must be a dict of training data, got {type(train_data).__name__}"
        )
    unknown = sorted(set(train_data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise TrainDataError(
            path,
            str(unknown[0]),
            f"is not a key tether trains with (keys {unknown}); it takes {', '.join(REQUIRED + OPTIONAL)}",
        )
    for key in REQUIRED:
        if key not in train_data:
            raise TrainDataError(path, key, "is missing (required: " + ", ".join(REQUIRED) + ")")
    tokens = [[int(t) for t in _host(row)] for row in _column(path, "tokens", train_data["tokens"], None)]
    n = len(tokens)
    if n == 0:
        raise TrainDataError(path, "tokens", "holds no sample")
    lengths = [int(x) for x in _column(path, "response_lengths", train_data["response_lengths"], n)]
    for i, (row, length) in enumerate(zip(tokens, lengths, strict=True)):
        if not 0 < length < len(row):
            raise TrainDataError(
                path,
                f"response_lengths[{i}]",
                f"is {length}; must be in 1..len(tokens[{i}])-1={len(row) - 1}",
            )
        if any(t < 0 for t in row):
            raise TrainDataError(path, f"tokens[{i}]", "holds a negative token id")
    rewards = np.asarray(_column(path, "rewards", train_data["rewards"], n), dtype=np.float64)
    raw = (
        np.asarray(_column(path, "raw_reward", train_data["raw_reward"], n), dtype=np.float64)
        if train_data.get("raw_reward") is not None
        else rewards.copy()
    )
    for key, col in (("rewards", rewards), ("raw_reward", raw)):
        if not np.isfinite(col).all():
            raise TrainDataError(path, key, "holds a non-finite value")
    masks = _per_token(path, "loss_masks", train_data["loss_masks"], lengths, np.int64)
    if not np.isin(masks, (0, 1)).all():
        raise TrainDataError(path, "loss_masks", "must hold only 0 and 1")
    log_probs = (
        _per_token(path, "rollout_log_probs", train_data["rollout_log_probs"], lengths, np.float32)
        if train_data.get("rollout_log_probs") is not None
        else None
    )
    if log_probs is not None:
        log_probs = np.where(masks == 1, log_probs, 0.0).astype(
            np.float32
        )  # tether's contract: 0 where masked
    if train_data.get("rollout_ids") is not None:
        rollout_ids = np.asarray(_column(path, "rollout_ids", train_data["rollout_ids"], n), dtype=np.int64)
    else:
        rollout_ids = np.arange(n, dtype=np.int64)  # slime's rule: a sample without one is its own rollout
    if train_data.get("sample_indices") is not None:
        indices = np.asarray(_column(path, "sample_indices", train_data["sample_indices"], n), dtype=np.int64)
    else:
        indices = np.full(n, -1, dtype=np.int64)
    group_of = {s.index: s.group_index for s in samples if s.index is not None and s.group_index is not None}
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(row) for row in tokens], out=offsets[1:])
    batch = TrainBatch(
        tokens=np.fromiter((t for row in tokens for t in row), dtype=np.int32, count=int(offsets[-1])),
        offsets=offsets,
        response_lengths=np.asarray(lengths, dtype=np.int32),
        loss_masks=masks.astype(np.uint8),
        rewards=rewards.astype(np.float32),
        raw_rewards=raw.astype(np.float32),
        rollout_ids=rollout_ids,
        sample_indices=indices,
        group_indices=np.array([group_of.get(int(i), -1) for i in indices], dtype=np.int64),
        loss_weights=np.zeros(n, dtype=np.float64),
        rollout_log_probs=log_probs,
    )
    if train_data.get("truncated") is not None:
        _column(path, "truncated", train_data["truncated"], n)  # slime logs it; nothing trains on it
    if train_data.get("rollout_mask_sums") is not None:
        given = np.asarray(
            _column(path, "rollout_mask_sums", train_data["rollout_mask_sums"], n), dtype=np.int64
        )
        trainable = batch.trainable_per_sample()
        ids, inverse = np.unique(rollout_ids, return_inverse=True)
        derived = np.bincount(inverse, weights=trainable, minlength=ids.size)[inverse].astype(np.int64)
        if not np.array_equal(given, derived):
            raise TrainDataError(
                path,
                "rollout_mask_sums",
                f"{given.tolist()[:8]} differ from the loss-mask totals per rollout id {derived.tolist()[:8]}, "
                "from which tether derives its loss denominators",
            )
    batch.loss_weights = step_loss_weights(batch, per_rollout_loss_mean=per_rollout_loss_mean)
    try:
        batch.validate()
    except ValueError as exc:
        raise TrainDataError(path, "return value", str(exc)) from exc
    return batch


# ----- --rollout-data-postprocess-path -----
def _real(shard: TrainBatch) -> np.ndarray:
    """Indices of the shard's samples that are not filler (filler: zero loss weight and mask)."""
    return np.flatnonzero((shard.loss_weights != 0) | (shard.trainable_per_sample() > 0))


def rollout_data_view(
    shard: TrainBatch,
    real: np.ndarray,
    entropy: Mapping[str, np.ndarray] | None = None,
    raw_reward: Sequence[float] | np.ndarray | None = None,
) -> dict[str, Any]:
    """slime's rollout_data for the `real` samples of one DP shard (see the module docstring);
    `entropy` (--use-rollout-entropy): the log-prob passes' per-token entropy under slime's keys
    (`entropy`, `ref_entropy`, `teacher_entropy`), shown to the hook, not taken back; `raw_reward`:
    the whole rollout's, in sample order (default: the shard's)."""
    import torch

    ro = shard.response_offsets

    def rows(col: np.ndarray, dtype: Any) -> list[Any]:
        return [torch.from_numpy(np.array(col[ro[i] : ro[i + 1]], dtype=dtype)) for i in real]

    data: dict[str, Any] = {
        "tokens": [torch.from_numpy(shard.sample_tokens(int(i)).astype(np.int64)) for i in real],
        "response_lengths": [int(shard.response_lengths[i]) for i in real],
        "total_lengths": [int(shard.total_lengths[i]) for i in real],
        "rewards": [float(shard.rewards[i]) for i in real],
        "raw_reward": [float(r) for r in raw_reward]
        if raw_reward is not None
        else [float(shard.raw_rewards[i]) for i in real],
        "local_raw_reward": [float(shard.raw_rewards[i]) for i in real],
        "sample_indices": [int(shard.sample_indices[i]) for i in real],
        "rollout_ids": [int(shard.rollout_ids[i]) for i in real],
        # slime's: each sample's position in the rollout, i.e. its index in `raw_reward`
        "partition": shard.rollout_positions()[real].tolist(),
        "loss_masks": rows(shard.loss_masks, np.int32),
    }
    for key, col in (
        ("rollout_log_probs", shard.rollout_log_probs),
        ("log_probs", shard.old_log_probs),
        ("ref_log_probs", shard.ref_log_probs),
        ("advantages", shard.advantages),
    ):
        if col is not None:
            data[key] = rows(col, np.float32)
    if shard.advantages is not None:
        data["returns"] = rows(shard.advantages, np.float32)
    for key, col in (entropy or {}).items():
        data[key] = rows(col, np.float32)
    return data


def _take_back(
    path: str, shard: TrainBatch, real: np.ndarray, data: Mapping[str, Any], shown: set[str]
) -> bool:
    """Write the hook's changes into `shard`; True when a loss mask changed."""
    added = sorted(set(data) - shown - set(TAKEN_BACK))
    if added:
        raise TrainDataError(
            path, added[0], f"was added to rollout_data, but tether trains only with {', '.join(TAKEN_BACK)}"
        )
    ro = shard.response_offsets
    lengths = [int(shard.response_lengths[i]) for i in real]
    changed = False
    for key in TAKEN_BACK:
        if key not in data:
            if key in shown:
                raise TrainDataError(path, key, "was removed from rollout_data")
            continue
        dtype = np.int64 if key == "loss_masks" else np.float32
        values = _per_token(path, key, data[key], lengths, dtype)
        attr = {"log_probs": "old_log_probs"}.get(key, key)
        column = getattr(shard, attr)
        if column is None:
            column = np.zeros(int(shard.response_lengths.sum()), dtype=np.float32)
            setattr(shard, attr, column)
        if key == "loss_masks" and not np.isin(values, (0, 1)).all():
            raise TrainDataError(path, key, "must hold only 0 and 1")
        start = 0
        for i, n in zip(real, lengths, strict=True):
            part = values[start : start + n]
            if key == "loss_masks":
                changed = changed or not np.array_equal(column[ro[i] : ro[i + 1]], part)
            column[ro[i] : ro[i + 1]] = part
            start += n
    return changed


def postprocess_step(
    hook: Callable[[int, dict[str, Any]], Any],
    path: str,
    rollout_id: int,
    shards: Sequence[TrainBatch],
    *,
    per_rollout_loss_mean: bool,
    entropy: Sequence[Mapping[str, np.ndarray]] | None = None,
    raw_reward: Sequence[float] | np.ndarray | None = None,
) -> None:
    """--rollout-data-postprocess-path over each DP shard of one step (see the module docstring);
    `entropy[dp_rank]`: that shard's log-prob passes' entropy under slime's keys; `raw_reward`: the
    whole rollout's raw rewards, which every shard's hook call sees (as slime ships them)."""
    reals = [_real(shard) for shard in shards]
    masks_changed = False
    for i, (shard, real) in enumerate(zip(shards, reals, strict=True)):
        data = rollout_data_view(shard, real, entropy[i] if entropy else None, raw_reward)
        shown = set(data)
        hook(rollout_id, data)
        masks_changed = _take_back(path, shard, real, data, shown) or masks_changed
    if masks_changed:
        _reweight(shards, reals, per_rollout_loss_mean=per_rollout_loss_mean)


def _reweight(
    shards: Sequence[TrainBatch], reals: Sequence[np.ndarray], *, per_rollout_loss_mean: bool
) -> None:
    """The step's loss weights over every shard's real samples, after the hook changed loss masks."""
    trainable = np.concatenate(
        [shard.trainable_per_sample()[real] for shard, real in zip(shards, reals, strict=True)]
    )
    rollout_ids = np.concatenate([shard.rollout_ids[real] for shard, real in zip(shards, reals, strict=True)])
    # A stand-in batch whose samples hold exactly these trainable counts: all step_loss_weights reads.
    lengths = np.maximum(trainable, 1)
    probe = TrainBatch(
        tokens=np.zeros(0, dtype=np.int32),
        offsets=np.zeros(1, dtype=np.int64),
        response_lengths=lengths.astype(np.int32),
        loss_masks=np.concatenate(
            [np.ones(n, dtype=np.uint8) if n else np.zeros(1, dtype=np.uint8) for n in trainable.tolist()]
        )
        if trainable.size
        else np.zeros(0, dtype=np.uint8),
        rewards=np.zeros(trainable.size, dtype=np.float32),
        raw_rewards=np.zeros(trainable.size, dtype=np.float32),
        rollout_ids=rollout_ids,
        sample_indices=np.zeros(trainable.size, dtype=np.int64),
        group_indices=np.zeros(trainable.size, dtype=np.int64),
        loss_weights=np.zeros(trainable.size, dtype=np.float64),
    )
    weights = step_loss_weights(probe, per_rollout_loss_mean=per_rollout_loss_mean)
    start = 0
    for shard, real in zip(shards, reals, strict=True):
        shard.loss_weights[real] = weights[start : start + real.size]
        start += real.size


# ----- --log-correct-samples -----
def correct_sample_metrics(shards: Sequence[TrainBatch], max_response_len: int) -> dict[str, float]:
    """slime's --log-correct-samples over the samples a step trained on (raw reward 1): the fraction
    of them whose response length falls in each quarter of `max_response_len`, and their mean
    negative log-prob under the trainer (per sample over its loss-masked tokens, then over samples;
    only when the step computed the trainer's log-probs)."""
    cuts = [max_response_len * q / 4 for q in (1, 2, 3)] + [float(max_response_len)]
    counts = [0, 0, 0, 0]
    nll: list[float] = []
    have_log_probs = all(s.old_log_probs is not None for s in shards)
    for shard in shards:
        ro = shard.response_offsets
        for i in _real(shard):
            if shard.raw_rewards[i] != 1:
                continue
            length = int(shard.response_lengths[i])
            # slime's quantile(): the first bin whose cut point is at or above the length (longer: none)
            for b, cut in enumerate(cuts):
                if length <= cut:
                    counts[b] += 1
                    break
            if have_log_probs:
                assert shard.old_log_probs is not None
                mask = shard.loss_masks[ro[i] : ro[i + 1]].astype(np.float64)
                lp = shard.old_log_probs[ro[i] : ro[i + 1]].astype(np.float64)
                nll.append(float(-(lp * mask).sum() / max(mask.sum(), 1.0)))
    total = sum(counts) + 1e-9
    out = {f"rollout/correct_length/p{p}": c / total for p, c in zip((25, 50, 75, 100), counts, strict=True)}
    out["rollout/correct_samples"] = float(sum(counts))
    if have_log_probs:
        out["rollout/correct_entropy"] = float(np.mean(nll)) if nll else 0.0
    return out

"""slime's hooks on the way from samples to training data, run where tether builds that data (the
head, `tether.train.rank.work`; `tether.run.train_data_hooks` loads them):

    --custom-reward-post-process-path   fn(args, samples) -> (raw_rewards, rewards)
    --custom-advantage-function-path    fn(args, rollout_data)   sets rollout_data["advantages"], ["returns"]

`rollout_data` holds, per sample and as slime's trainer holds them, `tokens`, `response_lengths`,
`total_lengths`, `rewards`, `raw_reward` (the whole rollout's, as slime ships it to every rank;
else the batch's), `local_raw_reward` (the batch's), `partition` (each sample's position in the
rollout, its index in `raw_reward`), `loss_masks`, `rollout_log_probs`, `log_probs` (the
trainer's, before the step; None when the step computes none), `ref_log_probs` (None likewise),
`kl` (zeros without --kl-coef) and `values` (the critic's under --advantage-estimator ppo, else
None). A hook's output is checked and refused, naming the hook, when it does not fit the samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tether.rollout.sample import Sample
from tether.train.config import AlgorithmConfig
from tether.train.rank.batching import TrainBatch

if TYPE_CHECKING:
    import torch


class TrainHookError(ValueError):
    """A hook's output does not fit the samples; names the hook's path and what is wrong."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"hook {path}: {reason}")


@dataclass(frozen=True)
class TrainDataHooks:
    """The hooks as the head loaded them: each called with what it gets here (the head binds
    `args` and converts to slime's Samples where the hook is written against slime's API)."""

    reward_post_process: Callable[[Sequence[Sample]], Any] | None = None
    reward_post_process_path: str = ""
    advantage: Callable[[dict[str, Any]], Any] | None = None
    advantage_path: str = ""
    convert_samples: Callable[[Sequence[Sample]], Any] | None = None
    """--custom-convert-samples-to-train-data-path (`tether.train.data.slime_train_data`)."""
    convert_samples_path: str = ""
    rollout_data_postprocess: Callable[[int, dict[str, Any]], Any] | None = None
    """--rollout-data-postprocess-path, called (rollout_id, rollout_data) (`tether.train.data.slime_train_data`)."""
    rollout_data_postprocess_path: str = ""


def post_process_rewards(
    hooks: TrainDataHooks, samples: Sequence[Sample]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(raw, processed) float64 rewards from --custom-reward-post-process-path; None without it."""
    if hooks.reward_post_process is None:
        return None
    path = hooks.reward_post_process_path
    result = hooks.reward_post_process(samples)
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise TrainHookError(path, f"returned {type(result).__name__}; expected (raw_rewards, rewards)")
    out = []
    for name, values in zip(("raw_rewards", "rewards"), result, strict=True):
        array = np.asarray(
            values.tolist() if hasattr(values, "tolist") else values, dtype=np.float64
        ).reshape(-1)
        if array.shape[0] != len(samples) or not np.isfinite(array).all():
            raise TrainHookError(
                path, f"{name} must be {len(samples)} finite numbers (one per sample), got {array.shape[0]}"
            )
        out.append(array)
    return out[0], out[1]


def _per_sample(flat: np.ndarray | None, lengths: list[int]) -> list[torch.Tensor] | None:
    import torch  # the trainer's dependency; `tether plan` checks hooks without it

    if flat is None:
        return None
    return list(torch.split(torch.from_numpy(np.asarray(flat, dtype=np.float32)), lengths))


def custom_advantages(
    hooks: TrainDataHooks,
    algorithm: AlgorithmConfig,
    batch: TrainBatch,
    rollout_raw_reward: Sequence[float] | np.ndarray | None = None,
) -> torch.Tensor:
    """Flat per-response-token advantages (float64) from --custom-advantage-function-path, before
    whitening; `hooks.advantage` must be set. `rollout_raw_reward`: the whole rollout's raw
    rewards in sample order, for `raw_reward` (default: the batch's)."""
    import torch

    from tether.train.algorithms.losses import approx_kl

    assert hooks.advantage is not None
    path = hooks.advantage_path
    lengths = [int(n) for n in batch.response_lengths]
    offsets = batch.offsets.tolist()
    log_probs = _per_sample(batch.old_log_probs, lengths)
    ref_log_probs = _per_sample(batch.ref_log_probs, lengths)
    masks = list(torch.split(torch.from_numpy(batch.loss_masks.astype(np.int64)), lengths))
    if algorithm.kl_coef != 0 and log_probs is not None and ref_log_probs is not None:
        kl = [
            approx_kl(lp, ref, algorithm.kl_loss_type)
            for lp, ref in zip(log_probs, ref_log_probs, strict=True)
        ]
    else:
        kl = [torch.zeros(n, dtype=torch.float32) for n in lengths]
    rollout_data: dict[str, Any] = {
        "tokens": [
            torch.from_numpy(batch.tokens[a:b].astype(np.int64)) for a, b in itertools.pairwise(offsets)
        ],
        "response_lengths": lengths,
        "total_lengths": [b - a for a, b in itertools.pairwise(offsets)],
        "rewards": batch.rewards.astype(np.float64).tolist(),
        "raw_reward": np.asarray(
            batch.raw_rewards if rollout_raw_reward is None else rollout_raw_reward, dtype=np.float64
        ).tolist(),
        "local_raw_reward": batch.raw_rewards.astype(np.float64).tolist(),
        # slime's: each sample's position in the rollout (its index in `raw_reward`)
        "partition": batch.rollout_positions().tolist(),
        "loss_masks": masks,
        "rollout_log_probs": _per_sample(batch.rollout_log_probs, lengths),
        "log_probs": log_probs,
        "ref_log_probs": ref_log_probs,
        "kl": kl,
        "values": _per_sample(batch.values, lengths),  # the critic's (ppo), else None
    }
    hooks.advantage(rollout_data)
    advantages = rollout_data.get("advantages")
    if not isinstance(advantages, list | tuple) or len(advantages) != len(lengths):
        raise TrainHookError(
            path, f"must set rollout_data['advantages'] to a list of {len(lengths)} tensors (one per sample)"
        )
    parts = []
    for i, (adv, n) in enumerate(zip(advantages, lengths, strict=True)):
        t = torch.as_tensor(adv, dtype=torch.float64).reshape(-1)
        if t.shape[0] != n or not torch.isfinite(t).all():
            raise TrainHookError(
                path,
                f"advantages of sample {i}: {t.shape[0]} values, expected {n} finite (its response tokens)",
            )
        parts.append(t)
    if "returns" not in rollout_data:
        raise TrainHookError(path, "must set rollout_data['returns'] too (slime's contract)")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

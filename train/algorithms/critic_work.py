"""A rollout as the PPO critic's work, in slime's order (its `train_critic`):

    work = CriticWork.build(groups, cfg.algorithm, options, dp_size=critic_dp)
    values = work.with_values(<per-DP values of work.value_requests()>)   # before any critic step
    for step in work.train_requests(rollout_id): <each critic rank trains on step[its dp_rank]>
    <the actor's steps get `values` (tether.train.rank.work.rollout_steps(..., values=values))>

The critic's values of the whole rollout are computed first, with its weights before this
rollout's steps: they are the value loss's old values and the actor's GAE baseline. The critic's
own targets are the GAE returns of the unshaped rewards (kl_coef 0: as slime's critic, which has
no policy log-probs), with the run's gamma and lambd; or, with --custom-advantage-function-path, the
`returns` that hook sets (slime's critic calls it too). The critic then makes as many optimizer
steps per rollout as the actor (the same --global-batch-size), each on its DP shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tether.rollout.sample import Sample
from tether.train.algorithms.gae import gae, ppo_token_rewards
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks, TrainHookError, custom_advantages
from tether.train.rank.batching import (
    TrainBatch,
    balanced_partition,
    plan_micro_batches,
    split_steps,
)
from tether.train.rank.protocol import MicroBatchPlan, TrainRequest, ValuesRequest
from tether.train.rank.work import WorkOptions, rollout_batch, shard_and_plan


def critic_returns(batch: TrainBatch, algorithm: AlgorithmConfig) -> np.ndarray:
    """float32 per-token GAE returns of `batch` from its rewards and its `values` (no KL shaping)."""
    import torch

    if batch.values is None:
        raise ValueError("the batch has no critic values")
    lengths = batch.response_lengths.tolist()
    token_rewards = ppo_token_rewards(torch.from_numpy(batch.rewards.astype(np.float32)), lengths)
    _, returns = gae(
        token_rewards, torch.from_numpy(batch.values), lengths, gamma=algorithm.gamma, lambd=algorithm.lambd
    )
    return returns.numpy().astype(np.float32)


def custom_critic_returns(hooks: TrainDataHooks, algorithm: AlgorithmConfig, batch: TrainBatch) -> np.ndarray:
    """float32 per-token returns from --custom-advantage-function-path: slime's critic calls that
    hook too (it replaces compute_advantages_and_returns) and trains towards its `returns`."""
    import torch

    captured: dict[str, Any] = {}
    assert hooks.advantage is not None
    hook = hooks.advantage

    def keep_returns(rollout_data: dict[str, Any]) -> None:
        hook(rollout_data)
        captured["returns"] = rollout_data.get("returns")

    custom_advantages(dataclasses.replace(hooks, advantage=keep_returns), algorithm, batch)
    lengths = [int(n) for n in batch.response_lengths]
    returns = captured.get("returns")
    if not isinstance(returns, list | tuple) or len(returns) != len(lengths):
        raise TrainHookError(
            hooks.advantage_path,
            f"must set rollout_data['returns'] to {len(lengths)} tensors (the critic's targets)",
        )
    parts = []
    for i, (ret, n) in enumerate(zip(returns, lengths, strict=True)):
        t = torch.as_tensor(ret, dtype=torch.float32).reshape(-1)
        if t.shape[0] != n or not torch.isfinite(t).all():
            raise TrainHookError(
                hooks.advantage_path, f"returns of sample {i}: {t.shape[0]} values, expected {n} finite"
            )
        parts.append(t)
    return torch.cat(parts).numpy()


def _dp_groups(batch: TrainBatch, dp_size: int, balance: bool) -> list[list[int]]:
    """Each DP rank's sample indices (as `shard_for_data_parallel` chooses them), kept here
    because the values come back per shard and go back to their samples."""
    if batch.num_samples < dp_size:
        raise ValueError(f"{batch.num_samples} samples cannot fill {dp_size} data-parallel ranks")
    if balance:
        return balanced_partition(batch.total_lengths, dp_size, equal_size=True)
    return [list(range(rank, batch.num_samples, dp_size)) for rank in range(dp_size)]


def _shard(batch: TrainBatch, group: list[int], size: int) -> TrainBatch:
    short = size - len(group)
    shortest = min(group, key=lambda i: (int(batch.total_lengths[i]), i))
    return batch.select(group + [shortest] * short, filler=[False] * len(group) + [True] * short)


class CriticWork:
    """One rollout's critic work: the value pass over the whole rollout, then its steps."""

    def __init__(
        self,
        batch: TrainBatch,
        algorithm: AlgorithmConfig,
        options: WorkOptions,
        dp_size: int,
        hooks: TrainDataHooks | None = None,
    ) -> None:
        self.batch = batch
        self.hooks = hooks
        self.algorithm = algorithm
        self.options = options
        self.dp_size = dp_size
        self._plans: list[MicroBatchPlan]
        if options.flops is not None:  # --balance-by-flops: its own shards, without filler
            groups, self._shards, self._plans = shard_and_plan(batch, dp_size, options)
            assert groups is not None
            self._groups = groups
        else:
            self._groups = _dp_groups(batch, dp_size, options.balance_data)
            size = max(len(g) for g in self._groups)
            self._shards = [_shard(batch, g, size) for g in self._groups]
            self._plans = plan_micro_batches(
                self._shards,
                micro_batch_size=options.micro_batch_size,
                max_tokens_per_gpu=options.max_tokens_per_gpu,
            )

    @classmethod
    def build(
        cls,
        groups: Sequence[Sequence[Sample]],
        algorithm: AlgorithmConfig,
        options: WorkOptions,
        *,
        dp_size: int,
        hooks: TrainDataHooks | None = None,
    ) -> CriticWork:
        """The rollout's samples, rewards as the actor's steps see them (the same post-processing)."""
        batch = rollout_batch(groups, algorithm, options.reward_key, hooks)
        return cls(batch, algorithm, options, dp_size, hooks)

    def value_requests(self) -> list[ValuesRequest]:
        """What each critic DP rank computes values over (index: dp_rank)."""
        return [ValuesRequest(shard=s, plan=p) for s, p in zip(self._shards, self._plans, strict=True)]

    def with_values(self, per_dp: Sequence[np.ndarray]) -> np.ndarray:
        """Attach each DP shard's values (`per_dp[dp_rank]`); the rollout's values in sample order
        (what the actor's advantages use). The returns follow from them."""
        if len(per_dp) != self.dp_size:
            raise ValueError(f"{len(per_dp)} value arrays for {self.dp_size} shards")
        ro = self.batch.response_offsets
        values = np.zeros(int(ro[-1]), dtype=np.float32)
        for group, shard, got in zip(self._groups, self._shards, per_dp, strict=True):
            got = np.asarray(got, dtype=np.float32)
            sro = shard.response_offsets
            if got.shape != (int(sro[-1]),):
                raise ValueError(f"values of shape {got.shape} for a shard of {int(sro[-1])} response tokens")
            for k, i in enumerate(group):  # the filler copies after the group are dropped
                values[ro[i] : ro[i + 1]] = got[sro[k] : sro[k + 1]]
        self.batch.values = values
        if self.hooks is not None and self.hooks.advantage is not None:
            self.batch.returns = custom_critic_returns(self.hooks, self.algorithm, self.batch)
        else:
            self.batch.returns = critic_returns(self.batch, self.algorithm)
        return values

    def train_requests(self, rollout_id: int) -> list[list[TrainRequest]]:
        """Each critic step's requests (index: dp_rank), in order; after `with_values`."""
        if self.batch.values is None:
            raise RuntimeError("the critic's values first (with_values)")
        num_steps = max(1, self.batch.num_samples // self.options.global_batch_size)
        steps = []
        per_rollout = self.algorithm.per_rollout_loss_mean
        for step_batch in split_steps(self.batch, num_steps, per_rollout_loss_mean=per_rollout):
            _, shards, plans = shard_and_plan(step_batch, self.dp_size, self.options)
            steps.append(
                [
                    TrainRequest(rollout_id=rollout_id, shard=s, plan=p)
                    for s, p in zip(shards, plans, strict=True)
                ]
            )
        return steps


__all__ = ["CriticWork", "critic_returns", "custom_critic_returns"]

"""A rollout's groups turned into each trainer rank's work, in one place.

    steps = rollout_steps(groups, cfg.algorithm, options, dp_size=dp)
    for step in steps:
        log_probs = {m: <per-DP log-probs of step.log_prob_requests(m)> for m in step.log_prob_models}
        step.with_log_probs(log_probs)
        <each rank trains on step.train_requests(rollout_id)[its dp_rank]>

What happens to a rollout, in order: rewards as the estimator uses them (group-normalised where
it says so), one columnar `TrainBatch`, split into optimizer steps (a rollout_id stays in one
step), then per step: advantages over the whole step (exact whitening), data-parallel shards
with filler so every rank runs the same number of micro-batches, and each shard's micro-batch
plan. When KL reward shaping is on, advantages need the per-shard old and reference log-probs
first, so they are computed per shard once those come back (`with_log_probs`).

Old log-probs are needed when the rollout makes more than one step (later steps are off-policy)
or for KL shaping, and with MoE routing replay (R2 records the routing in that forward);
reference log-probs for a KL loss or KL shaping; neither for SFT. A step's
log-probs must be computed with the weights as they are right before that step, so the caller
asks for them step by step, after the previous step has trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import torch

from tether.rollout.config import DataConfig
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.advantages import compute_advantages, process_rewards, whiten
from tether.train.batching import (
    TrainBatch,
    build_train_batch,
    plan_micro_batches,
    shard_for_data_parallel,
    split_steps,
)
from tether.train.config import AlgorithmConfig
from tether.train.protocol import LogProbModel, LogProbsRequest, MicroBatchPlan, TrainRequest
from tether.train.train_data_hooks import TrainDataHooks, custom_advantages, post_process_rewards


class WorkOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a rollout is cut into steps and micro-batches (from the run's data flags)."""

    global_batch_size: int  # samples per optimizer step (the rollout makes n // this steps, at least 1)
    micro_batch_size: int = 1
    max_tokens_per_gpu: int | None = None  # dynamic micro-batches of at most this many tokens when set
    reward_key: str | None = None  # selects the reward from a dict reward
    balance_data: bool = False  # --balance-data: balance DP shards' token counts (else round-robin)

    @classmethod
    def from_config(cls, data: DataConfig, reward_key: str | None) -> WorkOptions:
        """The options the run's data flags (and --reward-key) ask for."""
        return cls(
            global_batch_size=data.resolved_global_batch_size,
            micro_batch_size=data.micro_batch_size,
            max_tokens_per_gpu=data.max_tokens_per_gpu if data.use_dynamic_batch_size else None,
            reward_key=reward_key,
            balance_data=data.balance_data,
        )


def rollout_batch(
    groups: Sequence[Sequence[Sample]],
    algorithm: AlgorithmConfig,
    reward_key: str | None,
    hooks: TrainDataHooks | None = None,
) -> TrainBatch:
    """The rollout as one columnar batch with rewards as the estimator uses them (or as
    --custom-reward-post-process-path makes them)."""
    samples = [s for g in groups for s in g]
    custom = post_process_rewards(hooks, samples) if hooks is not None else None
    if custom is not None:
        raw, rewards = custom
    else:
        raw = np.array([s.scalar_reward(reward_key) for s in samples], dtype=np.float64)
        # A sample outside any group is a group of its own.
        group_ids = np.array(
            [s.group_index if s.group_index is not None else i for i, s in enumerate(samples)]
        )
        rewards = process_rewards(algorithm, raw, group_ids)
    return build_train_batch(
        samples, rewards=rewards, raw_rewards=raw, per_rollout_loss_mean=algorithm.per_rollout_loss_mean
    )


def batch_advantages(
    algorithm: AlgorithmConfig, batch: TrainBatch, hooks: TrainDataHooks | None = None
) -> np.ndarray:
    """float32 per-token advantages of `batch`, computed over the whole batch at once (by
    --custom-advantage-function-path when given, whitened after as slime does)."""
    if hooks is not None and hooks.advantage is not None:
        adv = custom_advantages(hooks, algorithm, batch)
        if algorithm.normalize_advantages:
            adv = whiten(adv, torch.from_numpy(batch.loss_masks.astype(np.float64)))
        return adv.numpy().astype(np.float32)
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a))  # noqa: E731
    adv = compute_advantages(
        algorithm,
        rewards=torch.from_numpy(batch.rewards.astype(np.float32)),
        response_lengths=batch.response_lengths.tolist(),
        loss_mask=torch.from_numpy(batch.loss_masks.astype(np.float32)),
        log_probs=as_tensor(batch.old_log_probs),
        ref_log_probs=as_tensor(batch.ref_log_probs),
    )
    return adv.numpy().astype(np.float32)


class StepWork:
    """One optimizer step: each data-parallel rank's shard and micro-batch plan, and the
    log-probs the ranks must compute before it can train."""

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        shards: list[TrainBatch],
        plans: list[MicroBatchPlan],
        log_prob_models: tuple[LogProbModel, ...],
        shaped: bool,
        hooks: TrainDataHooks | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.hooks = hooks
        self.shards = shards  # by dp_rank
        self.plans = plans  # by dp_rank
        self.log_prob_models = log_prob_models  # in the order the ranks compute them
        self.shaped = shaped  # advantages wait for the log-probs (KL reward shaping)
        self._attached = not log_prob_models

    @property
    def dp_size(self) -> int:
        return len(self.shards)

    @property
    def needs_log_probs(self) -> bool:
        """True until `with_log_probs` has attached what this step needs."""
        return not self._attached

    def log_prob_requests(self, model: LogProbModel) -> list[LogProbsRequest]:
        """What each DP rank computes `model`'s log-probs over (index: dp_rank)."""
        if model not in self.log_prob_models:
            raise ValueError(f"this step needs no {model!r} log-probs (needs {self.log_prob_models})")
        return [
            LogProbsRequest(shard=s, plan=p, model=model)
            for s, p in zip(self.shards, self.plans, strict=True)
        ]

    def with_log_probs(self, log_probs: Mapping[LogProbModel, Sequence[np.ndarray]]) -> None:
        """Attach each DP shard's log-probs (`log_probs[model][dp_rank]`, every model of
        `log_prob_models`); with KL shaping, the shards' advantages follow from them."""
        if set(log_probs) != set(self.log_prob_models):
            raise ValueError(f"log-probs of {sorted(log_probs)} given, the step needs {self.log_prob_models}")
        for model, per_dp in log_probs.items():
            if len(per_dp) != self.dp_size:
                raise ValueError(f"{len(per_dp)} {model!r} log-prob arrays for {self.dp_size} shards")
        for i, shard in enumerate(self.shards):
            old, ref = log_probs.get("actor"), log_probs.get("ref")
            shard.old_log_probs = None if old is None else np.asarray(old[i], dtype=np.float32)
            shard.ref_log_probs = None if ref is None else np.asarray(ref[i], dtype=np.float32)
            if self.shaped:
                # Each shard whitened on its own: the shaped rewards exist per shard only.
                shard.advantages = batch_advantages(self.algorithm, shard, self.hooks)
        self._attached = True

    def train_requests(self, rollout_id: int) -> list[TrainRequest]:
        """What each DP rank trains this step on (index: dp_rank)."""
        if not self._attached:
            raise RuntimeError(f"the step needs {self.log_prob_models} log-probs first (with_log_probs)")
        return [
            TrainRequest(rollout_id=rollout_id, shard=s, plan=p)
            for s, p in zip(self.shards, self.plans, strict=True)
        ]


def rollout_steps(
    groups: Sequence[Sequence[Sample]],
    algorithm: AlgorithmConfig,
    options: WorkOptions,
    *,
    dp_size: int,
    hooks: TrainDataHooks | None = None,
) -> list[StepWork]:
    """The optimizer steps a rollout makes, each cut into `dp_size` shards with their plans."""
    batch = rollout_batch(groups, algorithm, options.reward_key, hooks)
    if algorithm.use_rollout_routing_replay and batch.routed_experts is None:
        raise ConfigError(
            "--use-rollout-routing-replay",
            True,
            "the rollout's samples carry no rollout_routed_experts: the default rollout asks the engines "
            "for them; a custom rollout or generate function must too (return_routed_experts, as in slime)",
        )
    num_steps = max(1, batch.num_samples // options.global_batch_size)
    # --disable-compute-advantages-and-returns: no advantages and no log-probs for them (slime's meaning)
    rl = algorithm.loss_type != "sft_loss" and not algorithm.disable_compute_advantages_and_returns
    shaped = rl and algorithm.kl_coef != 0
    models: list[LogProbModel] = []
    # R2 (routing replay without R3) records the routing in the actor's log-prob forward, which
    # therefore runs before every step, as in slime.
    r2 = algorithm.use_routing_replay and not algorithm.use_rollout_routing_replay
    if (rl and (num_steps > 1 or algorithm.kl_coef != 0)) or r2:
        models.append("actor")
    if rl and algorithm.needs_ref_log_probs:
        models.append("ref")
    steps = []
    for step_batch in split_steps(batch, num_steps, per_rollout_loss_mean=algorithm.per_rollout_loss_mean):
        if rl and not shaped:
            # Over the whole step before sharding: whitening sees every token of the step.
            step_batch.advantages = batch_advantages(algorithm, step_batch, hooks)
        shards = shard_for_data_parallel(step_batch, dp_size, balance=options.balance_data)
        plans = plan_micro_batches(
            shards, micro_batch_size=options.micro_batch_size, max_tokens_per_gpu=options.max_tokens_per_gpu
        )
        steps.append(StepWork(algorithm, shards, plans, tuple(models), shaped, hooks))
    return steps


__all__ = ["StepWork", "WorkOptions", "batch_advantages", "rollout_batch", "rollout_steps"]

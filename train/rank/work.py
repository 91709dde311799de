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
first, so they are computed per shard once those come back (`with_log_probs`), and whitened with
the whole step's sums (`tether.train.algorithms.shard_whitening`, slime's all-reduce over the DP group).

Old log-probs are needed when the rollout makes more than one step (later steps are off-policy)
or for KL shaping, and with MoE routing replay (R2 records the routing in that forward);
reference log-probs for a KL loss or KL shaping; neither for SFT. On-policy distillation (--use-opd,
`tether.train.algorithms.opd`) needs the old log-probs (the student, unless --use-rollout-logprobs) and, with
--opd-type megatron, the teacher model's; its penalty then waits for them like KL shaping. A step's
log-probs must be computed with the weights as they are right before that step, so the caller
asks for them step by step, after the previous step has trained. The head does not call this
module itself: it hands a rollout over once to `tether.train.rank.rollout_calls`, which drives it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from tether.rollout.config import DataConfig
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.algorithms import opd
from tether.train.algorithms.advantages import (
    compute_advantages,
    needs_torch,
    process_rewards,
    reward_per_token,
    whiten,
)
from tether.train.algorithms.shard_whitening import AllReduce, whiten_across_shards
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks, custom_advantages, post_process_rewards
from tether.train.data.slime_train_data import postprocess_step, train_batch_from_train_data
from tether.train.model.hf_config import ModelArch
from tether.train.rank.batching import (
    TrainBatch,
    build_train_batch,
    plan_micro_batches,
    shard_for_data_parallel,
    split_steps,
)
from tether.train.rank.flops_balance import FlopsModel, flops_balanced_schedule, flops_model
from tether.train.rank.protocol import LogProbModel, LogProbsRequest, MicroBatchPlan, TrainRequest

if TYPE_CHECKING:
    import torch


class WorkOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a rollout is cut into steps and micro-batches (from the run's data flags)."""

    global_batch_size: int  # samples per optimizer step (the rollout makes n // this steps, at least 1)
    micro_batch_size: int = 1
    max_tokens_per_gpu: int | None = None  # dynamic micro-batches of at most this many tokens when set
    reward_key: str | None = None  # selects the reward from a dict reward
    balance_data: bool = False  # --balance-data: balance DP shards' token counts (else round-robin)
    # --balance-by-flops: micro-batches and DP shards balanced on this FLOPs estimate
    # (tether.train.rank.flops_balance); needs max_tokens_per_gpu
    flops: FlopsModel | None = None

    @classmethod
    def from_config(
        cls, data: DataConfig, reward_key: str | None, arch: ModelArch | None = None
    ) -> WorkOptions:
        """The options the run's data flags (and --reward-key) ask for; `arch` (the model's shape,
        from --hf-checkpoint) is needed with --balance-by-flops."""
        flops = None
        if data.balance_by_flops:
            if arch is None:
                raise ConfigError(
                    "--balance-by-flops", True, "needs the model's shape (--hf-checkpoint's config.json)"
                )
            flops = flops_model(arch)
        return cls(
            global_batch_size=data.resolved_global_batch_size,
            micro_batch_size=data.micro_batch_size,
            max_tokens_per_gpu=data.max_tokens_per_gpu if data.use_dynamic_batch_size else None,
            reward_key=reward_key,
            balance_data=data.balance_data,
            flops=flops,
        )


def shard_and_plan(
    batch: TrainBatch, dp_size: int, options: WorkOptions
) -> tuple[list[list[int]] | None, list[TrainBatch], list[MicroBatchPlan]]:
    """The DP shards of one step (or rollout) and each shard's micro-batch plan. With
    --balance-by-flops also each shard's sample indices into `batch` (its shards have no filler);
    otherwise None (`shard_for_data_parallel` chooses, filler included)."""
    if options.flops is not None:
        assert options.max_tokens_per_gpu is not None  # the flag needs --use-dynamic-batch-size
        schedule = flops_balanced_schedule(
            batch.total_lengths.tolist(), dp_size, options.max_tokens_per_gpu, options.flops
        )
        groups = [[i for mb in rank for i in mb] for rank in schedule]
        plans: list[MicroBatchPlan] = []
        for rank in schedule:
            starts = np.cumsum([0, *(len(mb) for mb in rank)]).tolist()
            plans.append([list(range(a, b)) for a, b in itertools.pairwise(starts)])
        return groups, [batch.select(g) for g in groups], plans
    shards = shard_for_data_parallel(batch, dp_size, balance=options.balance_data)
    plans = plan_micro_batches(
        shards, micro_batch_size=options.micro_batch_size, max_tokens_per_gpu=options.max_tokens_per_gpu
    )
    return None, shards, plans


def rollout_batch(
    groups: Sequence[Sequence[Sample]],
    algorithm: AlgorithmConfig,
    reward_key: str | None,
    hooks: TrainDataHooks | None = None,
) -> TrainBatch:
    """The rollout as one columnar batch with rewards as the estimator uses them (or as
    --custom-reward-post-process-path makes them)."""
    samples = [s for g in groups for s in g]
    if hooks is not None and hooks.convert_samples is not None:
        # --custom-convert-samples-to-train-data-path replaces the whole conversion, rewards included
        return train_batch_from_train_data(
            hooks.convert_samples_path,
            hooks.convert_samples(samples),
            samples,
            per_rollout_loss_mean=algorithm.per_rollout_loss_mean,
        )
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
    algorithm: AlgorithmConfig,
    batch: TrainBatch,
    hooks: TrainDataHooks | None = None,
    rollout_raw_reward: np.ndarray | None = None,
) -> np.ndarray:
    """float32 per-token advantages of `batch`, computed over the whole batch at once (by
    --custom-advantage-function-path when given, whitened after as slime does)."""
    return advantage_computation(algorithm, batch, hooks, rollout_raw_reward)(None)


def advantage_computation(
    algorithm: AlgorithmConfig,
    batch: TrainBatch,
    hooks: TrainDataHooks | None = None,
    rollout_raw_reward: np.ndarray | None = None,
) -> Callable[[AllReduce | None], np.ndarray]:
    """`batch`'s float32 per-token advantages as a function of the all-reduce their whitening
    uses (None: over `batch` alone; `tether.train.algorithms.shard_whitening` gives a step's shards the
    group's sums). --custom-advantage-function-path runs once, here, not once per call, and sees
    `rollout_raw_reward` (the whole rollout's) as `raw_reward`, as slime's rollout_data holds it."""
    if (hooks is None or hooks.advantage is None) and not needs_torch(algorithm):
        # Nothing to whiten, so `all_reduce` is never called (see whiten_across_shards).
        return lambda _all_reduce: reward_per_token(batch.rewards, batch.response_lengths, batch.loss_masks)
    import torch

    distill = opd_penalty(algorithm, batch)
    if hooks is not None and hooks.advantage is not None:
        custom = custom_advantages(hooks, algorithm, batch, rollout_raw_reward)
        if distill is not None:
            custom = distill(custom)

        def whitened(all_reduce: AllReduce | None) -> np.ndarray:
            adv = custom
            if algorithm.normalize_advantages:
                adv = whiten(adv, torch.from_numpy(batch.loss_masks.astype(np.float64)), all_reduce)
            return adv.numpy().astype(np.float32)

        return whitened
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a))  # noqa: E731

    def computed(all_reduce: AllReduce | None) -> np.ndarray:
        adv = compute_advantages(
            algorithm,
            rewards=torch.from_numpy(batch.rewards.astype(np.float32)),
            response_lengths=batch.response_lengths.tolist(),
            loss_mask=torch.from_numpy(batch.loss_masks.astype(np.float32)),
            log_probs=as_tensor(batch.old_log_probs),
            ref_log_probs=as_tensor(batch.ref_log_probs),
            values=as_tensor(batch.values),
            all_reduce=all_reduce,
            before_whitening=distill,
        )
        return adv.numpy().astype(np.float32)

    return computed


def opd_penalty(
    algorithm: AlgorithmConfig, batch: TrainBatch
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """--use-opd: what turns `batch`'s advantages into the distilled ones, before whitening."""
    if not algorithm.use_opd:
        return None
    rkl = opd.reverse_kl(algorithm, batch)
    return lambda adv: opd.apply_opd(adv, rkl, algorithm.opd_kl_coef)


def step_token_mean(shards: Sequence[TrainBatch], per_dp: Sequence[np.ndarray]) -> float:
    """The step mean of a per-response-token value, weighted as the step's loss weighs its tokens
    (filler copies weigh nothing)."""
    total = weight = 0.0
    for shard, values in zip(shards, per_dp, strict=True):
        w = np.repeat(shard.loss_weights, shard.response_lengths) * shard.loss_masks
        total += float((np.asarray(values, dtype=np.float64) * w).sum())
        weight += float(w.sum())
    return total / weight if weight > 0 else 0.0


def entropy_key(model: LogProbModel) -> str:
    """slime's name for a log-prob pass's entropy (its store prefix): entropy, ref_entropy, ..."""
    return "entropy" if model == "actor" else f"{model}_entropy"


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
        log_prob_plans: list[MicroBatchPlan] | None = None,
        rollout_raw_reward: np.ndarray | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.hooks = hooks
        # The whole rollout's raw rewards, in sample order: what slime's rollout_data["raw_reward"]
        # holds on every rank (--rollout-data-postprocess-path); None: the shards' own.
        self.rollout_raw_reward = rollout_raw_reward
        self.shards = shards  # by dp_rank
        self.plans = plans  # by dp_rank
        # --log-probs-max-tokens-per-gpu: the log-prob passes' own micro-batches (else the training ones)
        self.log_prob_plans = log_prob_plans if log_prob_plans is not None else plans
        self.entropy: dict[LogProbModel, float] = {}  # --use-rollout-entropy: each pass's step mean
        self.entropy_per_dp: dict[LogProbModel, list[np.ndarray]] = {}  # ... and its per-token values
        self.log_prob_models = log_prob_models  # in the order the ranks compute them
        self.shaped = shaped  # advantages wait for the log-probs (KL reward shaping)
        self._attached = not log_prob_models
        self._postprocessed = False  # --rollout-data-postprocess-path runs once, before training

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
            LogProbsRequest(shard=s, plan=p, model=model, with_entropy=self.algorithm.use_rollout_entropy)
            for s, p in zip(self.shards, self.log_prob_plans, strict=True)
        ]

    def with_log_probs(
        self,
        log_probs: Mapping[LogProbModel, Sequence[np.ndarray]],
        entropy: Mapping[LogProbModel, Sequence[np.ndarray]] | None = None,
    ) -> None:
        """Attach each DP shard's log-probs (`log_probs[model][dp_rank]`, every model of
        `log_prob_models`); with KL shaping, the shards' advantages follow from them. `entropy`
        (--use-rollout-entropy): the passes' per-token entropy, kept as each pass's step mean."""
        if set(log_probs) != set(self.log_prob_models):
            raise ValueError(f"log-probs of {sorted(log_probs)} given, the step needs {self.log_prob_models}")
        for model, per_dp in log_probs.items():
            if len(per_dp) != self.dp_size:
                raise ValueError(f"{len(per_dp)} {model!r} log-prob arrays for {self.dp_size} shards")
        for model, per_dp in (entropy or {}).items():
            self.entropy[model] = step_token_mean(self.shards, per_dp)
            self.entropy_per_dp[model] = [np.asarray(e, dtype=np.float32) for e in per_dp]
        for i, shard in enumerate(self.shards):
            old, ref = log_probs.get("actor"), log_probs.get("ref")
            shard.old_log_probs = None if old is None else np.asarray(old[i], dtype=np.float32)
            shard.ref_log_probs = None if ref is None else np.asarray(ref[i], dtype=np.float32)
            if "teacher" in log_probs:  # --opd-type megatron: the trainer's teacher model
                shard.teacher_log_probs = np.asarray(log_probs["teacher"][i], dtype=np.float32)
        if self.shaped:
            # Computed per shard (the shaped rewards need each shard's log-probs), whitened with the
            # whole step's sums, as slime's distributed_masked_whiten all-reduces over the DP group.
            advantages = whiten_across_shards(
                [
                    advantage_computation(self.algorithm, shard, self.hooks, self.rollout_raw_reward)
                    for shard in self.shards
                ]
            )
            for shard, adv in zip(self.shards, advantages, strict=True):
                shard.advantages = adv
        self._attached = True

    def train_requests(self, rollout_id: int) -> list[TrainRequest]:
        """What each DP rank trains this step on (index: dp_rank)."""
        if not self._attached:
            raise RuntimeError(f"the step needs {self.log_prob_models} log-probs first (with_log_probs)")
        hook = self.hooks.rollout_data_postprocess if self.hooks is not None else None
        if hook is not None and not self._postprocessed:
            # After the log-prob passes and the advantages, where slime's actor calls it.
            assert self.hooks is not None
            postprocess_step(
                hook,
                self.hooks.rollout_data_postprocess_path,
                rollout_id,
                self.shards,
                per_rollout_loss_mean=self.algorithm.per_rollout_loss_mean,
                entropy=[
                    {entropy_key(m): per_dp[i] for m, per_dp in self.entropy_per_dp.items()}
                    for i in range(self.dp_size)
                ],
                raw_reward=self.rollout_raw_reward,
            )
        self._postprocessed = True
        return [
            TrainRequest(rollout_id=rollout_id, shard=s, plan=p)
            for s, p in zip(self.shards, self.plans, strict=True)
        ]

    def log_prob_metrics(self) -> dict[str, float]:
        """slime's rollout/log_probs and rollout/ref_log_probs: the step mean of the actor's and the
        reference's log-prob passes (weighted as the step's loss weighs tokens); nothing for a pass
        that did not run."""
        out = {}
        for key, per_dp in (
            ("rollout/log_probs", [s.old_log_probs for s in self.shards]),
            ("rollout/ref_log_probs", [s.ref_log_probs for s in self.shards]),
        ):
            if self._attached and all(v is not None for v in per_dp):
                out[key] = step_token_mean(self.shards, [v for v in per_dp if v is not None])
        return out

    def entropy_metrics(self) -> dict[str, float]:
        """--use-rollout-entropy: slime's rollout/entropy (the actor's log-prob pass), rollout/ref_entropy
        (the reference's) and rollout/teacher_entropy; nothing for a pass that did not run."""
        return {f"rollout/{entropy_key(m)}": v for m, v in self.entropy.items()}

    def opd_metrics(self, *, per_token_loss: bool) -> dict[str, float]:
        """--use-opd: slime's `opd_reverse_kl` of this step, averaged as the step's loss averages
        tokens (`per_token_loss`: --calculate-per-token-loss); nothing without OPD."""
        if not self.algorithm.use_opd:
            return {}
        rkls = [opd.reverse_kl(self.algorithm, s) for s in self.shards]
        return {opd.METRIC: opd.step_metric(self.shards, rkls, per_token=per_token_loss)}


def rollout_steps(
    groups: Sequence[Sequence[Sample]],
    algorithm: AlgorithmConfig,
    options: WorkOptions,
    *,
    dp_size: int,
    hooks: TrainDataHooks | None = None,
    values: np.ndarray | None = None,
) -> list[StepWork]:
    """The optimizer steps a rollout makes, each cut into `dp_size` shards with their plans.

    `values` (ppo): the critic's per-response-token values of the rollout, in sample order
    (`tether.train.algorithms.critic_work`); the actor's GAE advantages come from them."""
    batch = rollout_batch(groups, algorithm, options.reward_key, hooks)
    # Where each sample sits in the rollout (slime's `partition`): carried into every step and shard.
    batch.positions = batch.rollout_positions()
    if values is not None:
        batch.values = np.asarray(values, dtype=np.float32)
        batch.validate()
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
    if rl and algorithm.advantage_estimator == "ppo" and batch.values is None:
        raise ValueError("advantage estimator ppo: the rollout needs the critic's values (values=...)")
    # --use-opd: the distillation penalty needs the trainer's student (unless --use-rollout-logprobs)
    # and teacher (--opd-type megatron) log-probs, as KL shaping needs the old and reference ones.
    opd_student, opd_teacher = (
        rl and opd.trainer_computes_student(algorithm),
        rl and opd.teacher_on_trainer(algorithm),
    )
    shaped = rl and (algorithm.kl_coef != 0 or opd_student or opd_teacher)
    models: list[LogProbModel] = []
    # R2 (routing replay without R3) records the routing in the actor's log-prob forward, which
    # therefore runs before every step, as in slime.
    r2 = algorithm.records_routing_per_step
    # --keep-old-actor: the old log-probs always come from the old actor's weights (as in slime).
    old_actor = algorithm.keep_old_actor
    # --get-mismatch-metrics: the trainer's old log-probs, against the engines', every step (slime's).
    mismatch = algorithm.get_mismatch_metrics
    if (rl and (num_steps > 1 or algorithm.kl_coef != 0 or old_actor or mismatch)) or r2 or opd_student:
        models.append("actor")
    if rl and algorithm.needs_ref_log_probs:
        models.append("ref")
    if opd_teacher:
        models.append("teacher")
    steps = []
    for step_batch in split_steps(batch, num_steps, per_rollout_loss_mean=algorithm.per_rollout_loss_mean):
        if rl and not shaped:
            # Over the whole step before sharding: whitening sees every token of the step.
            step_batch.advantages = batch_advantages(algorithm, step_batch, hooks, batch.raw_rewards)
        _, shards, plans = shard_and_plan(step_batch, dp_size, options)
        log_prob_plans = None
        budget = algorithm.log_probs_max_tokens_per_gpu
        if (
            models
            and options.max_tokens_per_gpu is not None
            and budget not in (None, options.max_tokens_per_gpu)
            # --balance-by-flops: the log-prob passes run the training micro-batches, as slime's one
            # schedule does (a FLOPs shard may hold too few samples for a token plan's count)
            and options.flops is None
        ):
            log_prob_plans = plan_micro_batches(
                shards, micro_batch_size=options.micro_batch_size, max_tokens_per_gpu=budget
            )
        steps.append(
            StepWork(
                algorithm,
                shards,
                plans,
                tuple(models),
                shaped,
                hooks,
                log_prob_plans,
                rollout_raw_reward=batch.raw_rewards,
            )
        )
    return steps


__all__ = ["StepWork", "WorkOptions", "batch_advantages", "rollout_batch", "rollout_steps", "shard_and_plan"]

"""One rollout's work on the trainer ranks, handed over once: the calls the head dispatches.

The head gives a rollout's groups to `actor_calls` (or `critic_calls`) once and drives the
generator it returns. Each item is one collective call, every data-parallel rank's request of one
kind (`LogProbsCall`, `TrainCall`, `ValuesCall`, index: dp_rank); the head sends back one result
per DP rank (same index) and gets the next call, until the generator returns the rollout's
`Trained`. Which log-prob passes run, their order against the steps, the advantages, the
rollout's bounds and the step metrics are decided here, so the head only dispatches:

    calls = actor_calls(groups, rollout_id, algorithm, options, dp_size=dp)
    results = None
    while True:
        try:
            call = calls.send(results)
        except StopIteration as done:
            trained = done.value
            break
        results = <each DP rank's answer to call.requests[dp_rank]>
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tether.rollout.sample import Sample
from tether.train.algorithms.critic_work import CriticWork
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks
from tether.train.data.slime_train_data import correct_sample_metrics
from tether.train.rank.batching import TrainBatch
from tether.train.rank.protocol import (
    LogProbModel,
    LogProbsRequest,
    LogProbsResult,
    TrainRequest,
    TrainResult,
    ValuesRequest,
    ValuesResult,
)
from tether.train.rank.work import StepWork, WorkOptions, rollout_steps


@dataclass(frozen=True)
class LogProbsCall:
    """Every DP rank computes one model's log-probs over its shard (`rank.compute_log_probs`)."""

    requests: list[LogProbsRequest]


@dataclass(frozen=True)
class TrainCall:
    """Every DP rank makes one optimizer step on its shard (`rank.train`)."""

    requests: list[TrainRequest]


@dataclass(frozen=True)
class ValuesCall:
    """Every critic DP rank computes the values of its shard (`rank.compute_values`)."""

    requests: list[ValuesRequest]


RankCall = LogProbsCall | TrainCall | ValuesCall
Results = Sequence[LogProbsResult] | Sequence[TrainResult] | Sequence[ValuesResult]


@dataclass
class Trained:
    """What a rollout's calls leave: the last step's metrics (slime's names), what each step
    trained on (index: step, then dp_rank; after --rollout-data-postprocess-path), the number of
    optimizer steps, and (critic) the rollout's values in sample order."""

    metrics: dict[str, float] = field(default_factory=dict)
    shards: list[list[TrainBatch]] = field(default_factory=list)
    steps: int = 0
    values: np.ndarray | None = None


Calls = Generator[RankCall, Results, Trained]


class StepChecks(Protocol):
    """Checks the head makes while a rollout trains (--ci-test and the grad-norm files:
    tether.run.ci_checks); a failure raises and the rollout's calls stop."""

    def rollout_data(self, rollout_id: int, metrics: Mapping[str, float]) -> None: ...

    def step(
        self, role: str, rollout_id: int, step_id: int, steps_per_rollout: int, metrics: Mapping[str, float]
    ) -> None: ...


@dataclass(frozen=True)
class StepMetricOptions:
    """What the step metrics report beside the ranks' own (from the run's flags)."""

    per_token_loss: bool = False  # --calculate-per-token-loss: how OPD's reverse KL is averaged
    # --log-correct-samples with --rollout-max-response-len: correct-sample metrics over this length
    correct_samples_max_len: int | None = None


def actor_calls(
    groups: Sequence[Sequence[Sample]],
    rollout_id: int,
    algorithm: AlgorithmConfig,
    options: WorkOptions,
    *,
    dp_size: int,
    hooks: TrainDataHooks | None = None,
    values: np.ndarray | None = None,
    metric_options: StepMetricOptions = StepMetricOptions(),
    checks: StepChecks | None = None,
) -> Calls:
    """The actor's calls for one rollout: its log-prob passes and optimizer steps.

    As slime: every step's old and reference log-probs (and the advantages built on them) come
    from the weights before the rollout's first step, so a later step's importance ratio is
    against the policy that generated the rollout. R2 routing replay records the routing in the
    log-prob pass the next step replays, so there each step's pass runs right before it.
    `values` (ppo): the critic's values of the rollout, in sample order."""
    steps = rollout_steps(groups, algorithm, options, dp_size=dp_size, hooks=hooks, values=values)
    per_step_passes = algorithm.records_routing_per_step
    if not per_step_passes:
        for step in steps:
            yield from _log_probs(step)
    trained = Trained()
    rollout_metrics: dict[str, float] = {}
    for i, step in enumerate(steps):
        if per_step_passes:
            yield from _log_probs(step)
        if i == 0:
            # The rollout's data as slime logs (and --ci-test checks) it before training: with R2's
            # per-step passes, the first step's.
            rollout_metrics = _rollout_log_prob_metrics(steps if not per_step_passes else steps[:1])
            if checks is not None:
                checks.rollout_data(rollout_id, {**rollout_metrics, **step.entropy_metrics()})
        requests = step.train_requests(rollout_id)
        _mark_rollout_bounds(requests, i, len(steps))
        results = yield TrainCall(requests)
        step_metrics = _train_results(results)[0].metrics
        if checks is not None:
            checks.step("actor", rollout_id, i, len(steps), step_metrics)
        trained.metrics = {f"train/{k}": float(v) for k, v in step_metrics.items()}
        trained.metrics.update(rollout_metrics)
        opd_metrics = step.opd_metrics(per_token_loss=metric_options.per_token_loss)
        trained.metrics.update({f"train/{k}": v for k, v in opd_metrics.items()})  # --use-opd
        trained.metrics.update(step.entropy_metrics())  # --use-rollout-entropy: rollout/entropy, ...
        trained.shards.append([r.shard for r in requests])
        trained.steps += 1
    max_len = metric_options.correct_samples_max_len
    if max_len is not None:  # over the rollout's samples as trained (after the post-process hook)
        trained.metrics.update(correct_sample_metrics([s for step in trained.shards for s in step], max_len))
    return trained


def critic_calls(
    groups: Sequence[Sequence[Sample]],
    rollout_id: int,
    algorithm: AlgorithmConfig,
    options: WorkOptions,
    *,
    dp_size: int,
    hooks: TrainDataHooks | None = None,
    checks: StepChecks | None = None,
) -> Calls:
    """The critic's calls for one rollout: its values of every response token (its weights
    before the rollout), then its value-loss steps. `Trained.values` holds the values in sample
    order (the actor's GAE baseline), its metrics the last step's under slime's train/critic-*."""
    work = CriticWork.build(groups, algorithm, options, dp_size=dp_size, hooks=hooks)
    results = yield ValuesCall(work.value_requests())
    trained = Trained(values=work.with_values([r.values for r in _values_results(results)]))
    all_requests = work.train_requests(rollout_id)
    for i, requests in enumerate(all_requests):
        _mark_rollout_bounds(requests, i, len(all_requests))
        step_results = yield TrainCall(requests)
        step_metrics = _train_results(step_results)[0].metrics
        if checks is not None:
            checks.step("critic", rollout_id, i, len(all_requests), step_metrics)
        trained.metrics = {f"train/critic-{k}": float(v) for k, v in step_metrics.items()}
        trained.shards.append([r.shard for r in requests])
        trained.steps += 1
    return trained


def _log_probs(step: StepWork) -> Generator[RankCall, Results, None]:
    """The log-prob passes `step` needs, one call per model (each is a collective call), with
    the weights as they are now; attached to the step once all have come back."""
    if not step.needs_log_probs:
        return
    log_probs: dict[LogProbModel, list[np.ndarray]] = {}
    entropy: dict[LogProbModel, list[np.ndarray]] = {}  # --use-rollout-entropy
    for model in step.log_prob_models:
        results = _log_probs_results((yield LogProbsCall(step.log_prob_requests(model))))
        log_probs[model] = [r.log_probs for r in results]
        if results and all(r.entropy is not None for r in results):
            entropy[model] = [r.entropy for r in results if r.entropy is not None]
    step.with_log_probs(log_probs, entropy)


def _rollout_log_prob_metrics(steps: Sequence[StepWork]) -> dict[str, float]:
    """rollout/log_probs and rollout/ref_log_probs over the given steps (each step's mean, weighted
    by its samples, as slime averages over the rollout's samples)."""
    sums: dict[str, float] = {}
    total = 0
    for step in steps:
        n = sum(s.num_samples for s in step.shards)
        total += n
        for key, value in step.log_prob_metrics().items():
            sums[key] = sums.get(key, 0.0) + value * n
    return {k: v / total for k, v in sums.items()} if total else {}


def _mark_rollout_bounds(requests: Sequence[TrainRequest], step: int, steps: int) -> None:
    """Mark where the rollout's steps start and end: the ranks reset the optimizer
    (--reset-optimizer-states) before the first and update the reference (--ref-update-interval)
    after the last, once per rollout as slime does."""
    for request in requests:
        request.first_of_rollout, request.last_of_rollout = step == 0, step == steps - 1
        request.step_id = step


def _checked(results: Results, kind: type, call: str) -> list:  # type: ignore[type-arg]
    if not results or not all(isinstance(r, kind) for r in results):
        got = sorted({type(r).__name__ for r in results}) if results else "nothing"
        raise TypeError(f"the answers to a {call} must be {kind.__name__}s, one per DP rank; got {got}")
    return list(results)


def _train_results(results: Results) -> list[TrainResult]:
    return _checked(results, TrainResult, "TrainCall")


def _values_results(results: Results) -> list[ValuesResult]:
    return _checked(results, ValuesResult, "ValuesCall")


def _log_probs_results(results: Results) -> list[LogProbsResult]:
    return _checked(results, LogProbsResult, "LogProbsCall")


__all__ = [
    "Calls",
    "LogProbsCall",
    "RankCall",
    "StepChecks",
    "StepMetricOptions",
    "TrainCall",
    "Trained",
    "ValuesCall",
    "actor_calls",
    "critic_calls",
]

"""The PPO critic on a trainer rank: the actor's architecture with a 1-wide value head, its values
over a shard, and its value-loss step (slime's critic role).

The critic is built like the actor (same flags, same HF weights, its own optimizer and scheduler;
slime's critic inherits every actor argument), except that the last stage's output layer becomes
a value head (`tether.train.model.value_head`). Position t's value belongs to response token t + 1,
as position t's logits do, so values line up with log-probs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tether.train.algorithms import losses
from tether.train.algorithms.gae import value_loss
from tether.train.config import AlgorithmConfig
from tether.train.parallel import context as context_parallel
from tether.train.rank import step
from tether.train.rank.batching import MicroBatchTensors, TrainBatch


def _values_of(out: torch.Tensor, mb: MicroBatchTensors) -> torch.Tensor:
    """[N] values of the micro-batch's response tokens from the head's output [b, s, 1]."""
    return context_parallel.full_response(out.reshape(-1)[mb.response_index.to(out.device)], mb)


def compute_values(
    critic: Any,
    shard: TrainBatch,
    plan: Sequence[Sequence[int]],
    before: Callable[[], None] | None = None,
) -> np.ndarray:
    """float32 [sum(response_lengths)]: the critic's value of every response token of the shard,
    in shard order; every rank of a DP group returns the same (broadcast from the last stage).
    `before`: called once the chunks are in eval mode (--custom-megatron-before-log-prob-hook-path)."""

    def keep(out: torch.Tensor, mb: MicroBatchTensors) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return out.new_zeros(()), {"values": _values_of(out, mb).detach().float().cpu()}

    for chunk in critic.chunks:
        chunk.eval()
    if before is not None:
        before()
    mbs = step.build_micro_batches(
        shard, plan, config=critic.config, max_length=step._max_length(critic.chunks)
    )
    with torch.no_grad():
        per_mb = step.run_schedule(critic.chunks, critic.config, mbs, keep, forward_only=True)
    result: np.ndarray | None = None
    if per_mb:
        ro = shard.response_offsets
        result = np.zeros(int(shard.response_lengths.sum()), dtype=np.float32)
        for idx, m in zip(plan, per_mb, strict=True):
            pos = np.concatenate([np.arange(ro[i], ro[i + 1]) for i in idx])
            result[pos] = m["values"].numpy()
    result = step._broadcast_from_last_stage(result)
    assert result is not None
    return result


def value_train_step(
    critic: Any,
    shard: TrainBatch,
    plan: Sequence[Sequence[int]],
    algo: AlgorithmConfig,
    before: Callable[[], None] | None = None,
) -> dict[str, float]:
    """One critic optimizer step on the clipped value loss; metrics (value_loss, value_clipfrac,
    grad_norm, lr, ...) the same on every rank, as `step.train_step` reports the actor's.
    `before`: called once the gradients are zeroed (--custom-megatron-before-train-step-hook-path)."""
    if shard.values is None or shard.returns is None:
        raise ValueError("a critic step needs the shard's old values and returns")
    start = time.perf_counter()
    for chunk in critic.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    critic.optimizer.zero_grad()
    if before is not None:
        before()
    mbs = step.build_micro_batches(
        shard, plan, config=critic.config, max_length=step._max_length(critic.chunks)
    )
    per_token = bool(critic.config.calculate_per_token_loss)

    def loss_fn(out: torch.Tensor, mb: MicroBatchTensors) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert mb.values is not None and mb.returns is not None
        dev = out.device
        weight = mb.loss_mask if per_token else mb.token_weight
        loss, metrics = value_loss(
            _values_of(out, mb),
            mb.values.to(dev),
            mb.returns.to(dev),
            weight.to(dev),
            algo.value_clip,
        )
        metrics["trainable_tokens"] = mb.loss_mask.sum().detach()
        return loss, metrics

    # slime recomputes its value loss as well
    run_loss = step.recomputed(loss_fn) if algo.recompute_loss_function else loss_fn
    per_mb = step.run_schedule(critic.chunks, critic.config, mbs, run_loss, forward_only=False)
    ok, grad_norm, _ = critic.optimizer.step()
    lr = float(critic.optimizer.param_groups[0]["lr"])
    if ok:
        critic.scheduler.step(increment=1)
    metrics: dict[str, float] | None = None
    if per_mb:
        metrics = losses.sum_metrics(per_mb, all_reduce=step._dp_sum)
        if per_token:
            denominator = max(metrics["trainable_tokens"], 1.0)
            metrics = {k: v if k == "trainable_tokens" else v / denominator for k, v in metrics.items()}
    metrics = step._broadcast_from_last_stage(metrics) or {}
    metrics.update(
        grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
        lr=lr,
        step_applied=float(bool(ok)),
        step_seconds=time.perf_counter() - start,
    )
    return metrics


__all__ = ["compute_values", "value_train_step"]

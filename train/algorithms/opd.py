"""On-policy distillation (slime's --use-opd): a sampled reverse-KL penalty to a teacher, folded
into the advantages.

For every response token the student sampled, d_t = log pi_student(a_t) - log pi_teacher(a_t),
and the advantage becomes A_t - opd_kl_coef * d_t, after the advantage estimator (or a custom
advantage function) and before --normalize-advantages whitens them, on every response token (the
loss mask matters only to the whitening and the loss), as slime's `apply_opd_kl_to_advantages`.
The penalty needs each DP shard's log-probs, so it is applied shard by shard; the whitening then
uses the whole step's statistics (`tether.train.algorithms.shard_whitening`), as slime's all-reduce over the
data-parallel group does.

Whose log-probs (slime's choice): the student's are the engine's (`rollout_log_probs`) with
--use-rollout-logprobs, else the trainer's before the step (`old_log_probs`, so the actor's log-prob
forward always runs with OPD); the teacher's come from the Samples (`teacher_log_probs`, put there
during the rollout by slime's `on_policy_distillation` reward hooks; --opd-type sglang) or from the
teacher model the trainer ranks load from --opd-teacher-load (--opd-type megatron).

The metric `opd_reverse_kl` is d_t averaged over the step's trainable tokens the way the step's
loss averages them (its loss weights; a plain token mean with --calculate-per-token-loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tether.train.config import AlgorithmConfig

if TYPE_CHECKING:
    import torch
from tether.train.rank.batching import TrainBatch

METRIC = "opd_reverse_kl"
"""slime's name of the metric (logged as train/opd_reverse_kl)."""


def trainer_computes_student(algorithm: AlgorithmConfig) -> bool:
    """Whether the student's log-probs come from the trainer's actor forward (not the engine's)."""
    return algorithm.use_opd and not algorithm.use_rollout_logprobs


def teacher_on_trainer(algorithm: AlgorithmConfig) -> bool:
    """Whether the trainer ranks hold the teacher model (--opd-type megatron)."""
    return algorithm.use_opd and algorithm.opd_type == "megatron"


def reverse_kl(algorithm: AlgorithmConfig, batch: TrainBatch) -> np.ndarray:
    """float32 per response token: student minus teacher log-prob of the sampled token."""
    if algorithm.use_rollout_logprobs:
        student, name = batch.rollout_log_probs, "rollout_log_probs (--use-rollout-logprobs)"
    else:
        student, name = batch.old_log_probs, "old_log_probs (the actor's before the step)"
    if student is None:
        raise ValueError(f"--use-opd: the batch has no student log-probs ({name})")
    teacher = batch.teacher_log_probs
    if teacher is None:
        where = (
            "the teacher model's log-probs were not computed"
            if algorithm.opd_type == "megatron"
            else "no Sample carries teacher_log_probs: with --opd-type sglang the rollout must set them "
            "(slime's --custom-rm-path slime.rollout.on_policy_distillation.reward_func and "
            "--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards)"
        )
        raise ValueError(f"--use-opd with --opd-type {algorithm.opd_type}: {where}")
    return (np.asarray(student, dtype=np.float32) - np.asarray(teacher, dtype=np.float32)).astype(np.float32)


def apply_opd(advantages: torch.Tensor, rkl: np.ndarray, kl_coef: float) -> torch.Tensor:
    """advantages - kl_coef * rkl, token by token (flat, sample order)."""
    import torch

    d = torch.from_numpy(np.asarray(rkl, dtype=np.float32)).to(advantages.device, advantages.dtype)
    if d.shape != advantages.shape:
        raise ValueError(f"reverse KL has shape {tuple(d.shape)}, advantages {tuple(advantages.shape)}")
    return advantages - kl_coef * d


def step_metric(batches: Sequence[TrainBatch], rkls: Sequence[np.ndarray], *, per_token: bool) -> float:
    """`opd_reverse_kl` of one step made of `batches` (its DP shards, or the whole step):
    the loss's average of the reverse KL over trainable tokens (filler copies weigh 0)."""
    total, tokens = 0.0, 0.0
    for batch, rkl in zip(batches, rkls, strict=True):
        mask = batch.loss_masks.astype(np.float64)  # a filler copy's mask is all 0
        masked = np.asarray(rkl, dtype=np.float64) * mask
        if per_token:
            total += float(masked.sum())
            tokens += float(mask.sum())
        else:
            per_sample = np.add.reduceat(masked, batch.response_offsets[:-1])  # responses are never empty
            total += float((per_sample * batch.loss_weights).sum())
    if per_token:
        return total / tokens if tokens else 0.0
    return total


__all__ = [
    "METRIC",
    "apply_opd",
    "reverse_kl",
    "step_metric",
    "teacher_on_trainer",
    "trainer_computes_student",
]

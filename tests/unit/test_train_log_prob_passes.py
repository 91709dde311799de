"""The log-prob passes a step asks the ranks for, as slime's flags shape them: --get-mismatch-metrics
(the actor's pass every step), --log-probs-max-tokens-per-gpu (their own micro-batches),
--use-rollout-entropy (entropy in every pass, logged as slime's rollout/entropy)."""

from __future__ import annotations

import numpy as np
import pytest

from tether.config import resolve
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.rank.work import WorkOptions, rollout_steps

CUSTOM_TIS = "support.anything.fn"  # the path is only loaded on the ranks; here it only names one


def groups(n_groups: int, per_group: int = 2) -> list[list[Sample]]:
    out = []
    for g in range(n_groups):
        group = []
        for j in range(per_group):
            i = g * per_group + j
            length = 2 + i % 3
            group.append(
                Sample(
                    index=i,
                    group_index=g,
                    rollout_id=i,
                    tokens=[(i * 5 + k) % 40 + 1 for k in range(3 + length)],
                    response_length=length,
                    loss_mask=[1] * length,
                    rollout_log_probs=[-0.5] * length,
                    reward=float(j),
                )
            )
        out.append(group)
    return out


def test_mismatch_metrics_need_the_actors_log_probs_even_on_policy() -> None:
    (plain,) = rollout_steps(groups(2), AlgorithmConfig(), WorkOptions(global_batch_size=4), dp_size=1)
    assert plain.log_prob_models == ()
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=CUSTOM_TIS)
    (step,) = rollout_steps(groups(2), cfg, WorkOptions(global_batch_size=4), dp_size=1)
    assert step.log_prob_models == ("actor",)
    # also with --use-rollout-logprobs, where the loss needs no trainer log-probs (slime's extra pass)
    cfg = AlgorithmConfig(
        get_mismatch_metrics=True, custom_tis_function_path=CUSTOM_TIS, use_rollout_logprobs=True
    )
    (step,) = rollout_steps(groups(2), cfg, WorkOptions(global_batch_size=4), dp_size=1)
    assert step.log_prob_models == ("actor",)


def test_log_prob_passes_get_their_own_token_budget() -> None:
    options = WorkOptions(global_batch_size=4, max_tokens_per_gpu=8)  # two samples per 8 tokens at most
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, log_probs_max_tokens_per_gpu=64)
    (step,) = rollout_steps(groups(2), cfg, options, dp_size=1)
    train = step.plans[0]
    (ref,) = step.log_prob_requests("ref")
    assert len(train) > 1 and len(ref.plan) == 1  # every sample in one log-prob micro-batch
    assert sorted(i for mb in ref.plan for i in mb) == list(range(4))
    (same,) = rollout_steps(
        groups(2), AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1), options, dp_size=1
    )
    assert same.log_prob_requests("ref")[0].plan == same.plans[0]  # default: the training budget


def test_rollout_entropy_is_asked_for_and_logged_per_pass() -> None:
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, use_rollout_entropy=True)
    (step,) = rollout_steps(groups(2), cfg, WorkOptions(global_batch_size=4), dp_size=1)
    (request,) = step.log_prob_requests("ref")
    assert request.with_entropy
    n = int(request.shard.response_lengths.sum())
    entropy = np.linspace(0.0, 1.0, n, dtype=np.float32)
    step.with_log_probs({"ref": [np.zeros(n, np.float32)]}, {"ref": [entropy]})
    weights = np.repeat(request.shard.loss_weights, request.shard.response_lengths)
    expected = float((entropy * weights).sum() / weights.sum())
    assert step.entropy_metrics() == {"rollout/ref_entropy": pytest.approx(expected)}
    assert step.entropy_per_dp["ref"][0].tolist() == entropy.tolist()
    (off,) = rollout_steps(
        groups(2),
        AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1),
        WorkOptions(global_batch_size=4),
        dp_size=1,
    )
    assert not off.log_prob_requests("ref")[0].with_entropy


def test_log_prob_flags_are_checked_when_parsed() -> None:
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(log_probs_chunk_size=0)
    assert info.value.key == "--log-probs-chunk-size"
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(log_probs_max_tokens_per_gpu=64, use_routing_replay=True)
    assert info.value.key == "--log-probs-max-tokens-per-gpu"
    with pytest.raises(ConfigError, match="--use-dynamic-batch-size") as info:
        resolve(["--log-probs-max-tokens-per-gpu", "64"])
    assert info.value.key == "--log-probs-max-tokens-per-gpu"
    flags = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "32", "--log-probs-max-tokens-per-gpu", "64"]
    assert resolve(flags).algorithm.log_probs_max_tokens_per_gpu == 64

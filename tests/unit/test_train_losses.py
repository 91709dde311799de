"""Each loss term against a hand-computed small case; the step-mean reduction under every split."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.algorithms import losses
from tether.train.config import AlgorithmConfig
from tether.train.rank.batching import (
    build_train_batch,
    micro_batch_tensors,
    plan_micro_batches,
    shard_for_data_parallel,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_kl_estimators_match_hand_computed_values() -> None:
    lp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    log_r = [0.5, -1.0]
    assert losses.approx_kl(lp, ref, "k1").tolist() == pytest.approx(log_r)
    assert losses.approx_kl(lp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in log_r])
    k3 = [math.exp(-x) - 1 + x for x in log_r]
    assert losses.approx_kl(lp, ref, "k3").tolist() == pytest.approx(k3)
    assert losses.approx_kl(lp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    # low_var_kl clamps to [-10, 10]; k3 does not.
    far = losses.approx_kl(t(-20.0), t(0.0), "low_var_kl")
    assert far.item() == 10.0
    assert losses.approx_kl(t(-20.0), t(0.0), "k3").item() == pytest.approx(math.exp(20) - 21)
    weighted = losses.approx_kl(lp, ref, "k1", importance_ratio=t(2.0, 0.5))
    assert weighted.tolist() == pytest.approx([1.0, -0.5])


def test_ppo_clip_hand_case() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7 ; advantages +1, +1, -1, -1 ; eps 0.2 / 0.3
    ratio = t(1.5, 0.5, 1.1, 0.7)
    adv = t(1.0, 1.0, -1.0, -1.0)
    loss, clipped = losses.ppo_clip_loss(-ratio.log(), adv, eps_clip=0.2, eps_clip_high=0.3)
    # token 0: max(-1.5, -1.3) = -1.3 (clipped); token 1: max(-0.5, -0.8) = -0.5;
    # token 2: max(1.1, 1.1) = 1.1; token 3: max(0.7, 0.8) = 0.8 (clipped)
    assert loss.tolist() == pytest.approx([-1.3, -0.5, 1.1, 0.8])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_dual_clip_bounds_negative_advantages() -> None:
    ratio = t(10.0, 10.0)
    adv = t(-1.0, 1.0)
    loss, _ = losses.ppo_clip_loss(-ratio.log(), adv, 0.2, 0.2, eps_clip_c=3.0)
    # A<0: min(max(10, 1.2), 3) = 3 ; A>0: max(-10, -1.2) = -1.2 (dual clip does not apply)
    assert loss.tolist() == pytest.approx([3.0, -1.2])
    with pytest.raises(ValueError, match="eps_clip_c"):
        losses.ppo_clip_loss(-ratio.log(), adv, 0.2, 0.2, eps_clip_c=1.0)


def test_gspo_ratio_is_per_sequence_masked_mean() -> None:
    lp = t(-1.0, -2.0, -3.0, -0.5, -0.5)
    old = t(-1.5, -2.0, -1.0, -1.0, -0.5)
    mask = t(1.0, 1.0, 0.0, 1.0, 1.0)
    out = losses.sequence_mean_log_ratio(lp, old, mask, [3, 2])
    # seq 0: masked mean of (old - new) over tokens 0,1 = (-0.5 + 0) / 2 ; seq 1: (-0.5 + 0) / 2
    assert out.tolist() == pytest.approx([-0.25, -0.25, -0.25, -0.25, -0.25])
    cfg = AlgorithmConfig(advantage_estimator="gspo", eps_clip=10.0)
    w = mask / 4
    res = losses.policy_loss(
        cfg,
        log_probs=lp,
        token_weight=w,
        loss_mask=mask,
        response_lengths=[3, 2],
        advantages=t(1, 1, 1, 2, 2),
        old_log_probs=old,
    )
    r = math.exp(0.25)
    assert res.loss.item() == pytest.approx(-(r * 1 + r * 1 + r * 2 + r * 2) / 4)


def test_tis_weights_hand_case() -> None:
    res = losses.tis_weights(t(-1.0, -1.0, -1.0), t(-1.0, -2.0, 1.0), tis_clip=2.0, tis_clip_low=0.5)
    assert res.ratio.tolist() == pytest.approx([1.0, math.e, math.exp(-2)])
    assert res.weights.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert res.clipped.tolist() == [0.0, 1.0, 1.0]
    assert res.abs_deviation.tolist() == pytest.approx([0.0, math.e - 1, 1 - math.exp(-2)])


def test_policy_loss_combines_terms_and_reports_metrics() -> None:
    lp = t(-1.0, -2.0).requires_grad_()
    old = t(-1.0, -2.0)
    ref = t(-1.5, -1.0)
    rollout = t(-1.0, -2.5)
    adv = t(1.0, -1.0)
    entropy = t(0.5, 1.5)
    w = t(0.5, 0.5)
    cfg = AlgorithmConfig(
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01, use_tis=True, tis_clip=1.5
    )
    res = losses.policy_loss(
        cfg,
        log_probs=lp,
        token_weight=w,
        loss_mask=t(1, 1),
        response_lengths=[2],
        advantages=adv,
        old_log_probs=old,
        rollout_log_probs=rollout,
        ref_log_probs=ref,
        entropy=entropy,
    )
    tis = [1.0, min(math.exp(0.5), 1.5)]
    pg = 0.5 * (-1.0 * tis[0]) + 0.5 * (1.0 * tis[1])
    kl = 0.5 * 0.5 + 0.5 * -1.0
    expected = pg - 0.01 * 1.0 + 0.1 * kl
    assert res.loss.item() == pytest.approx(expected)
    m = res.metrics
    assert m["pg_loss"].item() == pytest.approx(pg)
    assert m["entropy"].item() == pytest.approx(1.0)
    assert m["kl_loss"].item() == pytest.approx(kl)
    assert m["pg_clipfrac"].item() == 0.0
    assert m["tis_clipfrac"].item() == pytest.approx(0.5)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.25)
    assert m["train_rollout_ratio"].item() == pytest.approx(0.5 * (1 + math.exp(0.5)))
    res.loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def test_policy_loss_gradient_is_minus_advantage_on_policy() -> None:
    # On-policy (ratio 1, no clipping): d loss / d logp_t = -A_t * w_t.
    lp = t(-1.0, -0.3, -2.0).requires_grad_()
    w = t(0.2, 0.3, 0.0)
    res = losses.policy_loss(
        AlgorithmConfig(),
        log_probs=lp,
        token_weight=w,
        loss_mask=t(1, 1, 0),
        response_lengths=[3],
        advantages=t(2.0, -1.0, 5.0),
    )
    res.loss.backward()
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([-0.4, 0.3, 0.0])


def test_opsm_drops_negative_advantage_sequences_that_moved_past_delta() -> None:
    # Three sequences of two tokens. Mean (old - new) per sequence: 0.3, 0.3, 0.0 (the third's
    # second token is loss-masked, so its 0.9 does not count). Sequence 1 (A < 0, moved 0.3 > 0.2) is
    # masked; sequence 0 has A > 0, sequence 2 has not moved: both keep their loss.
    lp = t(-1.0, -1.0, -1.0, -1.0, -1.0, -1.9).requires_grad_()
    old = t(-0.7, -0.7, -0.7, -0.7, -1.0, -1.0)
    adv = t(1.0, 1.0, -1.0, -1.0, -1.0, -1.0)
    mask = t(1, 1, 1, 1, 1, 0)
    w = t(0.2, 0.2, 0.2, 0.2, 0.2, 0.0)

    def run(**flags: object) -> losses.LossOutput:
        lp.grad = None
        cfg = AlgorithmConfig(eps_clip=10.0, **flags)  # type: ignore[arg-type]
        kw = dict(token_weight=w, loss_mask=mask, response_lengths=[2, 2, 2], advantages=adv)
        out = losses.policy_loss(cfg, log_probs=lp, old_log_probs=old, **kw)  # type: ignore[arg-type]
        out.loss.backward()
        return out

    plain = run()
    plain_grad = lp.grad.clone()  # type: ignore[union-attr]
    masked = run(use_opsm=True, opsm_delta=0.2)
    assert masked.metrics["opsm_clipfrac"].item() == pytest.approx(0.4)  # 2 of the 5 weighted tokens
    assert lp.grad[2:4].tolist() == [0.0, 0.0]  # type: ignore[index]
    assert lp.grad[[0, 1, 4]].tolist() == pytest.approx(plain_grad[[0, 1, 4]].tolist())  # type: ignore[index]
    assert plain_grad[2:4].abs().min() > 0
    # A delta above the sequence's move masks nothing; slime's default 1e-4 masks sequence 1 too.
    assert run(use_opsm=True, opsm_delta=0.5).metrics["opsm_clipfrac"].item() == 0.0
    assert run(use_opsm=True).metrics["opsm_clipfrac"].item() == pytest.approx(0.4)
    assert "opsm_clipfrac" not in plain.metrics


def test_opsm_flags_are_refused_where_they_would_do_nothing() -> None:
    with pytest.raises(ConfigError, match="without --use-opsm") as err:
        AlgorithmConfig(opsm_delta=0.1)
    assert (err.value.key, err.value.value) == ("--opsm-delta", 0.1)
    with pytest.raises(ConfigError, match="masks the policy loss; --loss-type is sft_loss"):
        AlgorithmConfig(use_opsm=True, loss_type="sft_loss")


def test_sft_loss_is_weighted_nll() -> None:
    res = losses.sft_loss(log_probs=t(-1.0, -3.0, -9.0), token_weight=t(0.5, 0.5, 0.0))
    assert res.loss.item() == pytest.approx(2.0)


def test_missing_inputs_name_the_flag() -> None:
    base = {
        "log_probs": t(-1.0),
        "token_weight": t(1.0),
        "loss_mask": t(1.0),
        "response_lengths": [1],
        "advantages": t(1.0),
    }
    with pytest.raises(ValueError, match="--use-kl-loss"):
        losses.policy_loss(AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1), **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--use-tis"):
        losses.policy_loss(AlgorithmConfig(use_tis=True), **base)  # type: ignore[arg-type]


def test_sum_metrics_adds_micro_batches_and_checks_keys() -> None:
    out = losses.sum_metrics(
        [{"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, {"a": torch.tensor(0.5), "b": torch.tensor(1.0)}],
        all_reduce=lambda x: x * 2,
    )
    assert out == {"a": 3.0, "b": 6.0}
    with pytest.raises(ValueError, match="different metrics"):
        losses.sum_metrics([{"a": torch.tensor(1.0)}, {"b": torch.tensor(1.0)}])
    assert losses.megatron_loss_scale(4, 2) == 8.0


def _segments_as_samples(
    splits: list[int], token_losses: list[float], rollout_id: int, start: int
) -> list[Sample]:
    out = []
    pos = 0
    for k, n in enumerate(splits):
        out.append(
            Sample(
                index=start + k,
                group_index=0,
                rollout_id=rollout_id,
                tokens=[7, 8] + [1] * n,
                response_length=n,
                loss_mask=[1] * n,
                rollout_log_probs=[-0.1] * n,
                reward=1.0,
                metadata={"losses": token_losses[pos : pos + n]},
            )
        )
        pos += n
    return out


def _step_loss(
    samples: list[Sample], *, per_rollout: bool, dp: int, mbs: int | None, max_tokens: int | None
) -> float:
    batch = build_train_batch(samples, rewards=[1.0] * len(samples), per_rollout_loss_mean=per_rollout)
    # The per-token losses ride along as a column so they follow the samples through sharding.
    batch.advantages = np.concatenate([np.asarray(s.metadata["losses"], dtype=np.float32) for s in samples])
    shards = shard_for_data_parallel(batch, dp)
    plan = plan_micro_batches(shards, micro_batch_size=mbs or 1, max_tokens_per_gpu=max_tokens)
    total = 0.0
    for shard, mbs_of_rank in zip(shards, plan, strict=True):
        for idx in mbs_of_rank:
            mb = micro_batch_tensors(shard, idx)
            assert mb.advantages is not None
            total += float(losses.weighted_sum(mb.advantages.double(), mb.token_weight.double()))
    return total


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.booleans(), min_size=3, max_size=3),
    per_rollout=st.booleans(),
    dp=st.sampled_from([1, 2]),
    mbs=st.sampled_from([1, 2, None]),
    extra_samples=st.integers(0, 2),
)
def test_seed_article_example_holds_for_every_split(
    cuts: list[bool], per_rollout: bool, dp: int, mbs: int | None, extra_samples: int
) -> None:
    """Token losses [1, 3, 5, 7] of one rollout give 4.0 however they are cut into segments and spread
    over micro-batches and DP ranks, in both reductions. Other rollouts in the step have every token
    loss equal to 4.0, so the step mean stays 4.0 in both modes."""
    splits, run = [], 1
    for cut in cuts:
        if cut:
            splits.append(run)
            run = 1
        else:
            run += 1
    splits.append(run)
    samples = _segments_as_samples(splits, [1.0, 3.0, 5.0, 7.0], rollout_id=7, start=0)
    for k in range(extra_samples):
        samples += _segments_as_samples([k + 1], [4.0] * (k + 1), rollout_id=100 + k, start=10 + k)
    if len(samples) < dp:
        return
    max_tokens = None if mbs is not None else 16
    assert _step_loss(
        samples, per_rollout=per_rollout, dp=dp, mbs=mbs, max_tokens=max_tokens
    ) == pytest.approx(4.0)


def test_per_rollout_differs_from_per_token_when_rollouts_differ() -> None:
    # Rollout A: 4 tokens of loss [1,3,5,7] in two segments (mean 4); rollout B: 1 token of loss 10.
    samples = _segments_as_samples([2, 2], [1.0, 3.0, 5.0, 7.0], 0, 0) + _segments_as_samples(
        [1], [10.0], 1, 5
    )
    per_rollout = _step_loss(samples, per_rollout=True, dp=2, mbs=1, max_tokens=None)
    per_token = _step_loss(samples, per_rollout=False, dp=2, mbs=1, max_tokens=None)
    assert per_rollout == pytest.approx((4.0 + 10.0) / 2)  # not 8 (segments counted apart) nor 2 (halved)
    assert per_token == pytest.approx((16.0 + 10.0) / 5)

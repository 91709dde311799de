"""slime's loss-side flags on hand-computed micro-batches: CISPO, --custom-tis-function-path (slime's
own mis.py: tests/integration/test_slime_mis_hook.py), --get-mismatch-metrics,
--custom-pg-loss-reducer-function-path, their plan-time checks, and --custom-config-path's keys on
every hook's `args`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.loss_cases import hook, loaded_hooks, t, two_samples

from tether.checks.loss_hooks import check_loss_hooks
from tether.config import resolve
from tether.rollout.slime_api.args import slime_args
from tether.runtime.errors import ConfigError
from tether.train.algorithms import losses
from tether.train.algorithms.loss_hooks import hook_args
from tether.train.config import AlgorithmConfig


def test_cispo_clips_the_ratio_under_stop_gradient_and_keeps_every_tokens_gradient() -> None:
    # ratios 1.5, 0.5, 1.1 ; advantages +1, +1, -1 ; eps 0.2 / 0.3 -> truncated 1.3, 0.8, 1.1
    log_probs = t(-1.0, -2.0, -0.5).requires_grad_(True)
    ratio = t(1.5, 0.5, 1.1)
    old = log_probs.detach() - ratio.log()
    adv = t(1.0, 1.0, -1.0)
    loss, clipped = losses.cispo_loss(old - log_probs, log_probs, adv, eps_clip=0.2, eps_clip_high=0.3)
    assert loss.tolist() == pytest.approx([-1.3 * -1.0, -0.8 * -2.0, 1.1 * -0.5])
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    loss.sum().backward()
    # d/d log_prob of -sg(w) A log_prob is -w A: clipped tokens still pull (PPO's clip would give 0).
    assert log_probs.grad is not None
    assert log_probs.grad.tolist() == pytest.approx([-1.3, -0.8, 1.1])


def test_policy_loss_with_cispo_estimator_is_the_weighted_cispo_term() -> None:
    cfg = AlgorithmConfig(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.25)
    lp, old = t(-1.0, -2.0, -0.5), t(-1.5, -1.0, -0.5)
    adv, weight = t(1.0, -1.0, 2.0), t(0.5, 0.25, 0.25)
    out = losses.policy_loss(
        cfg,
        log_probs=lp,
        old_log_probs=old,
        token_weight=weight,
        loss_mask=t(1, 1, 1),
        response_lengths=[2, 1],
        advantages=adv,
    )
    # ratios e^0.5 (-> 1.25), e^-1 (lower bound 0 with eps_clip 1: kept), 1
    w = [1.25, math.exp(-1.0), 1.0]
    expected = sum(-wi * ai * li * ci for wi, ai, li, ci in zip(w, adv, lp, weight, strict=True))
    assert float(out.metrics["pg_loss"]) == pytest.approx(float(expected))
    assert float(out.metrics["pg_clipfrac"]) == pytest.approx(0.5)


def test_custom_tis_function_reweights_rejects_and_reports_as_slime(tmp_path: Path) -> None:
    config = tmp_path / "tis.yaml"
    config.write_text("cap: 2.0\nfloor: 0.75\n")
    cfg = AlgorithmConfig(
        use_tis=True,
        custom_tis_function_path=hook("reject_tis"),
        custom_config_path=str(config),
        entropy_coef=0.0,
    )
    out = two_samples(cfg, loaded_hooks(cfg))
    # ratio 1 -> 1 ; 3 -> 2 (cap) ; 0.5 -> rejected (below the floor) ; 1 -> 1. On-policy pg = -A.
    kept_pg = [-1.0 * 1.0, -2.0 * 2.0, 0.0, -4.0 * 1.0]
    assert float(out.metrics["pg_loss"]) == pytest.approx(0.25 * sum(kept_pg))
    # The hook's metric and ois are means over the original mask; the other terms over the kept tokens.
    assert float(out.metrics["ratio"]) == pytest.approx(0.25 * (1 + 3 + 0.5 + 1))
    assert float(out.metrics["ois"]) == pytest.approx(1.0)
    assert float(out.metrics["entropy"]) == pytest.approx(0.25 * (0.1 + 0.2 + 0.4))
    assert "tis" not in out.metrics  # the built-in TIS did not run


def test_builtin_tis_reports_ois_and_slimes_metric_names() -> None:
    cfg = AlgorithmConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.6)
    out = two_samples(cfg, None)
    assert float(out.metrics["pg_loss"]) == pytest.approx(0.25 * (-1.0 - 2.0 * 2.0 + 1.0 * 0.6 - 4.0))
    assert float(out.metrics["tis_clipfrac"]) == pytest.approx(0.5)
    assert float(out.metrics["ois"]) == pytest.approx(1.0)


def test_mismatch_metrics_run_the_function_without_changing_the_loss() -> None:
    with pytest.raises(ConfigError, match="--get-mismatch-metrics"):
        AlgorithmConfig(get_mismatch_metrics=True)  # slime: it needs the custom TIS function
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=hook("metrics_only_tis"))
    baseline = two_samples(AlgorithmConfig(), None)
    out = two_samples(cfg, loaded_hooks(cfg))
    assert float(out.loss) == pytest.approx(float(baseline.loss))
    assert float(out.metrics["abs_log_diff"]) == pytest.approx(0.25 * (math.log(3.0) + math.log(2.0)))
    assert "ois" in out.metrics and "ois" not in baseline.metrics


def test_a_tis_function_returning_the_wrong_shape_is_named() -> None:
    cfg = AlgorithmConfig(use_tis=True, custom_tis_function_path=hook("wrong_shape_tis"))
    with pytest.raises(
        losses.LossHookError, match=r"--custom-tis-function-path .*pg_loss must hold one value"
    ):
        two_samples(cfg, loaded_hooks(cfg))


def test_custom_pg_loss_reducer_replaces_only_the_pg_reduction() -> None:
    cfg = AlgorithmConfig(custom_pg_loss_reducer_function_path=hook("masked_sum_reducer"), entropy_coef=0.5)
    baseline = two_samples(AlgorithmConfig(entropy_coef=0.5), None)
    pg_sum = -1.0 - 2.0 + 1.0 - 4.0
    # slime divides a reduced loss by the step's sample count (here 4 over the whole step) ...
    out = two_samples(cfg, loaded_hooks(cfg, samples=4))
    assert float(out.metrics["pg_loss"]) == pytest.approx(pg_sum / 4)
    assert float(out.metrics["entropy"]) == pytest.approx(float(baseline.metrics["entropy"]))
    assert float(out.metrics["pg_clipfrac"]) == pytest.approx(float(baseline.metrics["pg_clipfrac"]))
    assert float(out.loss) == pytest.approx(pg_sum / 4 - 0.5 * float(baseline.metrics["entropy"]))
    # ... and, with --calculate-per-token-loss, leaves it to Megatron's division by the token count.
    per_token = two_samples(cfg, loaded_hooks(cfg, per_token=True, samples=4))
    assert float(per_token.metrics["pg_loss"]) == pytest.approx(10.0 * pg_sum)


def test_the_reducer_gets_the_masks_the_tis_function_left(tmp_path: Path) -> None:
    config = tmp_path / "tis.yaml"
    config.write_text("cap: 2.0\nfloor: 0.75\n")
    cfg = AlgorithmConfig(
        use_tis=True,
        custom_tis_function_path=hook("reject_tis"),
        custom_pg_loss_reducer_function_path=hook("masked_sum_reducer"),
        custom_config_path=str(config),
    )
    out = two_samples(cfg, loaded_hooks(cfg, samples=1))
    assert float(out.metrics["pg_loss"]) == pytest.approx(-1.0 - 4.0 - 4.0)  # token 3 rejected


def test_plan_refuses_bad_loss_hook_paths_and_signatures_by_flag(tmp_path: Path) -> None:
    check_loss_hooks(
        AlgorithmConfig(
            use_tis=True,
            custom_tis_function_path=hook("reject_tis"),
            custom_pg_loss_reducer_function_path=hook("masked_sum_reducer"),
        )
    )
    bad = [
        ("custom_tis_function_path", hook("no_such_function"), "--custom-tis-function-path", "no attribute"),
        (
            "custom_tis_function_path",
            hook("tis_without_keywords"),
            "--custom-tis-function-path",
            "cannot be called",
        ),
        ("custom_tis_function_path", "no_such_module.fn", "--custom-tis-function-path", "cannot be imported"),
        (
            "custom_pg_loss_reducer_function_path",
            hook("reject_tis"),
            "--custom-pg-loss-reducer-function-path",
            "cannot be called",
        ),
    ]
    for field, path, flag, why in bad:
        with pytest.raises(ConfigError, match=why) as info:
            check_loss_hooks(AlgorithmConfig(**{field: path}))  # type: ignore[arg-type]
        assert info.value.key == flag
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError) as info:
        check_loss_hooks(AlgorithmConfig(custom_config_path=str(tmp_path / "list.yaml")))
    assert info.value.key == "--custom-config-path"


def test_custom_config_keys_set_flags_and_reach_every_hooks_args(tmp_path: Path) -> None:
    config = tmp_path / "mis.yaml"
    # mis.yaml's shape: a flag (use_tis) and keys only the hook reads.
    config.write_text(
        "use_tis: true\ntis_mode: truncate\ntis_upper_bound: 2.0\nrs_lower_bound: null\neps_clip: 0.3\n"
    )
    cfg = resolve(["--custom-config-path", str(config), "--eps-clip", "0.1"])
    assert cfg.algorithm.use_tis is True
    assert cfg.algorithm.eps_clip == pytest.approx(0.3)  # the YAML overrides the command line, as in slime
    rollout_args = slime_args(cfg, router_ip=None, router_port=None)
    assert rollout_args["tis_mode"] == "truncate" and rollout_args["rs_lower_bound"] is None
    assert "use_tis" not in rollout_args  # answered by the configuration itself
    trainer_args = hook_args(cfg.algorithm, calculate_per_token_loss=False)
    assert trainer_args.tis_mode == "truncate" and trainer_args.tis_upper_bound == 2.0
    assert trainer_args.use_tis is True and trainer_args.eps_clip_high == pytest.approx(0.3)
    # A key naming a slime flag tether refuses is refused by name; a bad value names the key.
    config.write_text("use_distributed_post: true\n")
    with pytest.raises(ConfigError, match="use_distributed_post"):
        resolve(["--custom-config-path", str(config)])
    config.write_text("sglang_mem_fraction_static: 0.5\n")
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static"):
        resolve(["--custom-config-path", str(config)])
    config.write_text("eps_clip: -1\n")
    with pytest.raises(ConfigError, match=r"mis.yaml: eps_clip"):
        resolve(["--custom-config-path", str(config)])


def test_hooks_get_each_samples_total_length_from_the_padded_micro_batch() -> None:
    from support.train_checks.launcher import make_batch

    from tether.train.rank.batching import micro_batch_tensors
    from tether.train.rank.step import micro_batch_total_lengths

    batch = make_batch(5, seed=3)
    for multiple in (1, 4):  # sequence parallelism pads the sequence to a multiple of TP
        mb = micro_batch_tensors(batch, [4, 1, 2], pad_to_multiple_of=multiple)
        assert micro_batch_total_lengths(mb) == [int(batch.total_lengths[i]) for i in (4, 1, 2)]

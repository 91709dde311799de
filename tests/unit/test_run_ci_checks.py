"""slime's CI checks (--ci-test, --ci-save-grad-norm, --ci-load-grad-norm) as run-time assertions:
each check passes on values slime's would pass and stops the run, naming itself, on values it
would not; the flags are refused where slime would read them and do nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.config import resolve
from tether.run.ci_checks import CiCheckFailed, CiChecks, CiOptions, load_grad_norm, save_grad_norm
from tether.run.trainer_pool import ci_checks
from tether.runtime.errors import ConfigError

CI = CiChecks(CiOptions(ci_test=True))
GOOD_STEP = {"grad_norm": 1.0, "train_rollout_logprob_abs_diff": 0.01, "ppo_kl": 0.0, "pg_clipfrac": 0.0}


def test_rollout_data_checks() -> None:
    CI.rollout_data(0, {"rollout/log_probs": -0.4, "rollout/ref_log_probs": -0.4, "rollout/entropy": 0.5})
    with pytest.raises(CiCheckFailed, match=r"rollout 0: the actor's mean log-prob -0.4 differs"):
        CI.rollout_data(0, {"rollout/log_probs": -0.4, "rollout/ref_log_probs": -0.41})
    CI.rollout_data(1, {"rollout/log_probs": -0.4, "rollout/ref_log_probs": -0.41})  # rollout 0 only
    with pytest.raises(CiCheckFailed, match=r"rollout 3: rollout/log_probs=-5.8 is outside \(-1, 0\)"):
        CI.rollout_data(3, {"rollout/log_probs": -5.8})
    with pytest.raises(CiCheckFailed, match=r"rollout/entropy=1.5 is outside \(0, 1\)"):
        CI.rollout_data(2, {"rollout/entropy": 1.5})
    # --ci-disable-kl-checker and R3 (the reference routes on its own) skip only the KL comparison.
    for opts in (
        CiOptions(ci_test=True, kl_checker=False),
        CiOptions(ci_test=True, rollout_routing_replay=True),
    ):
        CiChecks(opts).rollout_data(0, {"rollout/log_probs": -0.4, "rollout/ref_log_probs": -0.5})
        with pytest.raises(CiCheckFailed, match="outside"):
            CiChecks(opts).rollout_data(0, {"rollout/log_probs": 0.2})
    CiChecks(CiOptions()).rollout_data(0, {"rollout/log_probs": -9.0})  # without --ci-test


def test_step_checks() -> None:
    CI.step("actor", 0, 0, 2, GOOD_STEP)
    with pytest.raises(CiCheckFailed, match=r"rollout 1 step 1: .*abs_diff=0.2 exceeds .*threshold=0.1"):
        CI.step("actor", 1, 1, 2, {**GOOD_STEP, "train_rollout_logprob_abs_diff": 0.2})
    CiChecks(CiOptions(ci_test=True, logprob_abs_diff_threshold=0.3)).step(
        "actor", 1, 1, 2, {**GOOD_STEP, "train_rollout_logprob_abs_diff": 0.2}
    )
    # ppo_kl: the first step of every rollout (the weights that sampled), with the clip fraction.
    with pytest.raises(CiCheckFailed, match=r"rollout 4 step 0: train/ppo_kl=0.001"):
        CI.step("actor", 4, 0, 2, {**GOOD_STEP, "ppo_kl": 1e-3})
    CI.step("actor", 4, 1, 2, {**GOOD_STEP, "ppo_kl": 1e-3})
    # kl_loss: the run's very first step only.
    with pytest.raises(CiCheckFailed, match=r"train/kl_loss=0.5 at the first step"):
        CI.step("actor", 0, 0, 2, {**GOOD_STEP, "kl_loss": 0.5})
    CI.step("actor", 0, 1, 2, {**GOOD_STEP, "kl_loss": 0.5})
    CiChecks(CiOptions(ci_test=True, kl_checker=False)).step("actor", 0, 0, 2, {**GOOD_STEP, "kl_loss": 0.5})
    CI.step("critic", 0, 0, 1, {"grad_norm": 2.0, "ppo_kl": 5.0, "pg_clipfrac": 0.0})  # actor checks only


def test_weight_versions_after_an_update() -> None:
    CI.weights(3, {"http://127.0.0.1:1": 3, "http://127.0.0.1:2": 3})
    with pytest.raises(CiCheckFailed, match=r"version 3, engines report other versions: .*:2': 2"):
        CI.weights(3, {"http://127.0.0.1:1": 3, "http://127.0.0.1:2": 2})
    CiChecks(CiOptions(save_grad_norm="x")).weights(3, {"e": None})


def test_grad_norms_saved_then_compared_as_slime_does(tmp_path: Path) -> None:
    template = str(tmp_path / "gn" / "{role}-{rollout_id}-{step_id}.pt")
    saver = CiChecks(CiOptions(save_grad_norm=template))
    saver.step("actor", 2, 1, 2, {"grad_norm": 1.25})
    saver.step("critic", 2, 0, 1, {"grad_norm": 0.5})
    saved = tmp_path / "gn" / "actor-2-1.pt"
    assert torch.load(saved, weights_only=True) == 1.25  # slime's format: torch.save of the float
    assert sorted(p.name for p in (tmp_path / "gn").iterdir()) == ["actor-2-1.pt", "critic-2-0.pt"]
    loader = CiChecks(CiOptions(load_grad_norm=template))
    loader.step("actor", 2, 1, 2, {"grad_norm": 1.26})  # within slime's 1%
    with pytest.raises(
        CiCheckFailed, match=r"actor rollout 2 step 1: grad norm 1.4 differs from 1.25 saved in"
    ):
        loader.step("actor", 2, 1, 2, {"grad_norm": 1.4})
    with pytest.raises(CiCheckFailed, match=r"no saved grad norm at .*actor-3-0.pt"):
        loader.step("actor", 3, 0, 2, {"grad_norm": 1.0})
    torch.save(torch.tensor(0.75), tmp_path / "t.pt")  # a tensor, as a slime rank may have saved
    assert load_grad_norm(tmp_path / "t.pt") == 0.75
    save_grad_norm(tmp_path / "f.pt", 2.0)
    assert load_grad_norm(tmp_path / "f.pt") == 2.0 and not list(tmp_path.glob(".*tmp"))


def test_flags_resolve_to_the_checks_and_are_refused_where_they_do_nothing(tmp_path: Path) -> None:
    assert ci_checks(resolve([])) is None
    checks = ci_checks(
        resolve(
            ["--ci-test", "--ci-disable-kl-checker", "--ci-train-rollout-logprob-abs-diff-threshold", "1e-6"]
        )
    )
    assert checks is not None
    assert (checks.options.kl_checker, checks.options.logprob_abs_diff_threshold) == (False, 1e-6)
    assert ci_checks(resolve(["--ci-test"])).options.logprob_abs_diff_threshold == 0.1  # type: ignore[union-attr]
    for argv, key in (
        (["--ci-disable-kl-checker"], "--ci-disable-kl-checker"),
        (
            ["--ci-train-rollout-logprob-abs-diff-threshold", "0.2"],
            "--ci-train-rollout-logprob-abs-diff-threshold",
        ),
        (["--ci-save-grad-norm", "a_{step_id}", "--ci-load-grad-norm", "b_{step_id}"], "--ci-load-grad-norm"),
        (["--ci-save-grad-norm", "{rank}.pt"], "--ci-save-grad-norm"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve(argv)
        assert err.value.key == key

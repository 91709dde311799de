"""--log-passrate (slime's meaning): pass@k for k = 1, 2, 4, ... up to the group size, from each
prompt's rewards with the unbiased estimator 1 - C(n-c, k) / C(n, k), averaged over the prompts."""

from __future__ import annotations

import math

import pytest

from tether.config import resolve
from tether.rollout.rollout_fn import rollout_metrics
from tether.rollout.sample import Sample


def group(*rewards: float) -> list[Sample]:
    return [Sample(prompt="p", reward=r) for r in rewards]


def test_log_passrate_adds_pass_at_k_to_the_rollout_metrics() -> None:
    groups = [group(1, 0, 0, 0), group(1, 1, 0, 0), group(0, 0, 0, 0)]
    off = rollout_metrics(groups, None, 1.0)
    on = rollout_metrics(groups, None, 1.0, log_passrate=True)
    assert not any(k.startswith("passrate/") for k in off)
    # pass@1 = c/n; pass@2 = 1 - C(n-c, 2)/C(4, 2); pass@4 = 1 if any passed.
    assert on["passrate/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert on["passrate/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6) + 0) / 3)
    assert on["passrate/pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert {k for k in on if k.startswith("passrate/")} == {
        "passrate/pass@1",
        "passrate/pass@2",
        "passrate/pass@4",
    }
    assert {k: v for k, v in on.items() if not k.startswith("passrate/")} == off


def test_log_passrate_k_stops_at_the_largest_power_of_two_in_the_group() -> None:
    on = rollout_metrics([group(1, 0, 0, 0, 0, 0)], None, 1.0, log_passrate=True)
    assert sorted(k for k in on if k.startswith("passrate/")) == [
        "passrate/pass@1",
        "passrate/pass@2",
        "passrate/pass@4",
    ]
    assert on["passrate/pass@4"] == pytest.approx(1 - math.comb(5, 4) / math.comb(6, 4))
    # Only a reward of exactly 1 passes; a group of one sample logs nothing (as slime).
    partial = rollout_metrics([group(0.5, 1)], None, 1.0, log_passrate=True)
    assert partial["passrate/pass@1"] == pytest.approx(0.5)
    assert not any(
        k.startswith("passrate/") for k in rollout_metrics([group(1)], None, 1.0, log_passrate=True)
    )


def test_log_passrate_flag_parses() -> None:
    run = ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    assert resolve([*run, "--log-passrate"]).rollout.log_passrate
    assert not resolve(run).rollout.log_passrate

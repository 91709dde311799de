"""MoE routing replay through tether's real log-prob pass and train step, on two gloo ranks (DP=2 and
PP=2) with a tiny Megatron MoE GPT (tests/support/train_checks/check_routing_replay.py says what each
value means)."""

from __future__ import annotations

from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

LAYOUTS = ["dp2", "pp2"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("routing_replay")
    log = work / "torchrun.log"
    rc = torchrun("check_routing_replay.py", str(work), log=log)
    assert rc == 0, log.read_text()[-5000:]
    return [results(work / "results" / f"rank{r}.json") for r in (0, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollout_routing_replay_uses_the_engines_experts(ranks: list[dict[str, Any]], layout: str) -> None:
    for rank, data in enumerate(ranks):
        value(data, f"{layout}/run")
        routers = value(data, f"{layout}/r3/routers")
        # Each PP stage hooks its own layer's router; DP ranks hold both.
        assert len(routers) == (1 if layout == "pp2" else 2), routers
        # Log-probs with the given experts equal Megatron's own forced routing, and not normal routing.
        assert value(data, f"{layout}/r3/max_diff_forced") < 1e-5
        assert value(data, f"{layout}/r3/max_diff_normal") > 1e-3
        # The training forward routed the same way: its NLL is that of the replayed log-probs.
        nll = value(data, f"{layout}/r3/sft_nll")
        assert nll == pytest.approx(value(data, f"{layout}/r3/nll_replayed"), abs=1e-5)
        assert abs(nll - value(data, f"{layout}/r3/nll_normal")) > 1e-4
        assert value(data, f"{layout}/r3/grad_norm") > 0
        assert value(data, f"{layout}/r3/left_after_step") is False  # every entry consumed, then cleared
        assert value(data, f"{layout}/r3/uninstalled") is True, rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_routing_replay_trains_with_the_recorded_experts(ranks: list[dict[str, Any]], layout: str) -> None:
    for data in ranks:
        recorded = value(data, f"{layout}/r2/recorded")
        assert recorded and all(n == recorded[0] and n > 0 for n in recorded)  # one entry per micro-batch
        nll = value(data, f"{layout}/r2/sft_nll")
        # The routers were changed after recording: the step replayed the record, not their new choice.
        assert nll == pytest.approx(value(data, f"{layout}/r2/nll_forced_recorded"), abs=1e-5)
        assert abs(nll - value(data, f"{layout}/r2/nll_own")) > 1e-4
        assert value(data, f"{layout}/r2/left_after_step") is False
        assert "0 entries recorded (by the actor's log-prob pass of this step)" in value(
            data, f"{layout}/r2/unrecorded_step"
        )

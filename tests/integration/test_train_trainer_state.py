"""slime's trainer-state flags on real Megatron ranks (one torchrun launch, 2 ranks at PP=2, of
tests/support/train_checks/check_trainer_state.py; each rank drives a TrainerWorker as the head
does): --ref-update-interval, --reset-optimizer-states, --keep-old-actor,
--freeze-params-name-list, --only-train-params-name-list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

Runs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("trainer_state")
    log = work / "trainer_state.log"
    rc = torchrun("check_trainer_state.py", str(work), log=log)
    assert rc == 0, log.read_text()[-5000:]
    out = [results(Path(work) / "results" / f"rank{r}.json") for r in (0, 1)]
    for rank in out:
        assert value(rank, "done")
    return out


def test_reference_takes_the_actors_weights_every_interval(runs: Runs) -> None:
    for rank in runs:
        got = value(rank, "ref_update")
        assert got["start"] == 0.0  # both loaded from the HF checkpoint
        assert got["after_rollout0"] > 1e-4  # rollout 0 trained the actor only
        assert got["after_rollout1"] == 0.0  # (1 + 1) % 2 == 0: the reference became the actor, exactly
        assert got["after_rollout2"] > 1e-4


def test_reset_optimizer_states_restarts_adam_at_each_rollout(runs: Runs) -> None:
    for rank in runs:
        got = value(rank, "reset")
        assert got["steps_reset=False"] == [1, 2, 3, 4]
        # Reset before each rollout's first step (slime's train()), not between its steps.
        assert got["steps_reset=True"] == [1, 2, 1, 2]
        after = got["after_reset"]
        assert after["step"] == 0 and after["moments"] == 0 and after["params"] > 0


def test_old_log_probs_come_from_the_old_actor(runs: Runs) -> None:
    for rank in runs:
        got = value(rank, "old_actor")
        assert got["start"] == 0.0
        assert got["trained_moved"] > 1e-4
        assert got["old_is_w0"] == 0.0  # old log-probs: the start weights, not the trained ones
        assert got["actor_back"] == 0.0  # the actor's own weights came back exactly
        assert got["after_update1_old_is_w0"] == 0.0  # --update-weights-interval 1: one update behind
        assert got["after_update2_old_is_w1"] == 0.0
        assert got["interval2_old_is_actor"] == 0.0


def test_frozen_parameters_stay_and_the_others_train(runs: Runs) -> None:
    """(The check also saves this partly frozen actor and resumes a fresh one from the checkpoint:
    the same weights, then it trains on.)"""
    for stage, rank in enumerate(runs):
        got = value(rank, "freeze")
        assert got["frozen"] and all("embedding" in n or "linear_fc1" in n for n in got["frozen"])
        # Layer numbers are the stage's own (slime's names): each stage froze its layer's linear_fc1.
        assert "decoder.layers.0.mlp.linear_fc1.weight" in got["frozen"]
        assert ("embedding.word_embeddings.weight" in got["frozen"]) == (stage == 0)
        assert got["changed"] == got["trainable"]  # every trainable weight moved, no frozen one did
        assert got["in_optimizer"] == len(got["trainable"])  # frozen ones hold no optimizer state


def test_only_train_list_trains_only_matches_even_with_a_stage_that_trains_nothing(runs: Runs) -> None:
    # ... and its checkpoint resumes on both stages (check_trainer_state.freeze asserts the weights).
    first, last = (value(r, "only_train") for r in runs)
    assert first["trainable"] == [] and first["changed"] == [] and first["in_optimizer"] == 0
    assert last["trainable"] == ["output_layer.weight"] and last["changed"] == ["output_layer.weight"]


def test_a_name_list_matching_nothing_is_refused_on_every_rank(runs: Runs) -> None:
    for rank in runs:
        got = value(rank, "refused")
        assert got["key"] == "--freeze-params-name-list" and got["value"] == "no_such_module"
        assert "matches no parameter" in got["message"]

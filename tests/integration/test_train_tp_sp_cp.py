"""TP=2 with sequence parallelism and CP=2 in one model (4 ranks on gloo): the layout long-context
runs on GPUs take. Each CP rank's load-balanced sequence chunks are split again over the TP ranks'
sequence shards; the logits still equal transformers' and two SFT steps' loss and grad norm equal
DP=4's, for dense attention (Qwen3) and for multi-latent attention with MoE (DeepSeek-V3).
See tests/support/train_checks/check_model.py (LAYOUTS_4)."""

from __future__ import annotations

from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

pytestmark = pytest.mark.timeout(900)

FAMILIES = ["qwen3", "deepseek_v3"]
RANKS = 4


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("train_tp_sp_cp")
    log = work / "torchrun.log"
    rc = torchrun("check_model.py", str(work), *FAMILIES, nproc=RANKS, log=log, timeout=800)
    assert rc == 0, log.read_text()[-5000:]
    return [results(work / "results" / f"rank{r}.json") for r in range(RANKS)]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sp_cp2_logits_equal_transformers_and_weights_round_trip(
    checked: list[dict[str, Any]], family: str
) -> None:
    for rank_results in checked:
        # the layout the model was built with, as Megatron's config holds it
        assert value(rank_results, f"tp2cp2/{family}/layout") == {
            "tp": 2,
            "cp": 2,
            "dp": 1,
            "sequence_parallel": True,
            "etp": 2,  # expert TP follows TP unless set apart
        }
        assert value(rank_results, f"dp4/{family}/layout")["dp"] == RANKS
        assert value(rank_results, f"tp2cp2/{family}/logits") < 1e-5
        got = value(rank_results, f"tp2cp2/{family}/round_trip")
        assert got["mismatched"] == [] and got["missing"] == [] and got["count"] > 0, got


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sp_cp2_training_steps_equal_dp4(checked: list[dict[str, Any]], family: str) -> None:
    for rank_results in checked:
        want = value(rank_results, f"dp4/{family}/train")
        got = value(rank_results, f"tp2cp2/{family}/train")
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)

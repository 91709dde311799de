"""Expert parallelism over NCCL: a tiny Qwen3-MoE at EP=2 with Megatron's alltoall dispatcher
on two GPUs gives the logits and the two SFT steps' loss and grad norm of EP=1 (DP=2), as the CPU
EP=2 checks do over gloo (tests/integration/test_train_model.py). Skipped without two CUDA
devices. One two-rank torchrun of tests/support/train_checks/check_expert_parallel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.train_checks.launcher import results, torchrun, value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)"
    ),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("expert_parallel")
    log = work / "torchrun.log"
    rc = torchrun("check_expert_parallel.py", str(work), nproc=2, log=log)
    assert rc == 0, log.read_text()[-5000:]
    return [results(Path(work) / "results" / f"rank{r}.json") for r in (0, 1)]


def test_ranks_ran_over_nccl(run: list[dict[str, Any]]) -> None:
    for rank_results in run:
        assert value(rank_results, "done") is True
        assert value(rank_results, "ep2/backend") == "nccl"


@pytest.mark.parametrize("layout", ["ep2", "tp2etp1", "tp2ep2etp1"])
def test_logits_equal_ep1(run: list[dict[str, Any]], layout: str) -> None:
    for rank_results in run:
        want = torch.tensor(value(rank_results, "ep1/logits"))
        got = torch.tensor(value(rank_results, f"{layout}/logits"))
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("layout", ["ep2", "tp2etp1", "tp2ep2etp1"])
def test_training_steps_equal_ep1(run: list[dict[str, Any]], layout: str) -> None:
    # Each rank holds half the experts at EP=2; at ETP=1 under TP=2 the experts are whole on both TP
    # ranks (their gradients summed over the expert data-parallel group) or split by EP=2. The loss
    # and the global grad norm (each expert's gradient counted once) equal EP=1's.
    for rank_results in run:
        want = value(rank_results, "ep1/train")
        got = value(rank_results, f"{layout}/train")
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)

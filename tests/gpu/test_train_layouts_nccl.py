"""The train-step layouts over NCCL on two GPUs: TP=2, PP=2, DP=2 and CP=2 (context parallelism,
TransformerEngine's attention where TE is installed, else tether's key/value-gathering attention)
give the same log-probs, losses and grad norms, as they do over gloo on CPU
(tests/integration/test_train_steps.py). Skipped without two CUDA devices. One two-rank torchrun of
tests/support/train_checks/check_train.py.
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
LAYOUTS = ["tp2", "pp2", "dp2", "cp2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("train_layouts_nccl")
    log = work / "torchrun.log"
    rc = torchrun("check_train.py", str(work), "train", nproc=2, log=log)
    assert rc == 0, log.read_text()[-5000:]
    return [results(Path(work) / "results" / f"train-rank{r}.json") for r in (0, 1)]


def test_layouts_agree_over_nccl(run: list[dict[str, Any]]) -> None:
    base_lp = value(run[0], "tp2/log_probs")
    base = value(run[0], "tp2/sft_metrics")
    for rank_results in run:
        for layout in LAYOUTS:
            assert value(rank_results, f"{layout}/log_probs") == pytest.approx(base_lp, abs=1e-4)
            metrics = value(rank_results, f"{layout}/sft_metrics")
            assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in base], abs=1e-3)
            assert [m["grad_norm"] for m in metrics] == pytest.approx(
                [m["grad_norm"] for m in base], rel=1e-3
            )

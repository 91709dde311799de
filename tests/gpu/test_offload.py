"""--offload-train on a real GPU (tether.train.state.offload): the trainer's weights, gradients, optimizer
state and the reference's weights leave device memory and come back bit for bit; skipped without
CUDA. One single-rank torchrun of tests/support/train_checks/check_offload.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.train_checks.launcher import results, torchrun, value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VARIANTS = [f"{p}/{o}" for p in ("fp32", "bf16") for o in ("plain", "distopt")]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("offload")
    log = work / "offload.log"
    rc = torchrun("check_offload.py", str(work), nproc=1, log=log)
    assert rc == 0, log.read_text()[-5000:]
    return results(Path(work) / "results" / "rank0.json")


@pytest.mark.parametrize("variant", VARIANTS)
def test_offload_frees_device_memory_and_restores_training(run: dict[str, Any], variant: str) -> None:
    resident, moved = value(run, f"{variant}/resident"), value(run, f"{variant}/offloaded")
    for m in moved["memory"]:
        # Weights, gradients and optimizer state: more than the weights alone, all freed.
        assert m["moved"] > moved["param_bytes"], m
        assert m["before"] - m["during"] >= 0.95 * m["moved"], m
        assert m["after"] == m["before"], m
    # The offloaded run trains exactly as the resident one: same losses, same final weights.
    assert moved["loss"] == resident["loss"]
    assert moved["digest"] == resident["digest"]
    assert moved["reference_digest"] == resident["reference_digest"]

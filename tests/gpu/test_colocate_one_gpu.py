"""`tether run --colocate` on ONE GPU: one trainer rank and one engine share the device.

The embedded engine (`--rollout-engine cpu`, started with `--device cuda` on a GPU plan) and a
single Megatron rank take turns with the GPU's memory in slime's order: the engine releases all
its memory right after launch, before the trainer builds its model; each step the engine
releases it again for training, the trainer offloads (--offload-train), the engine takes back its
weights, the trainer exports its own weights alone (brought back from host memory) as CUDA IPC
handles naming the GPU by UUID, then the engine takes back its KV cache and generates. Checked as
the CPU runs are (tests/support/e2e.py `check_run`): ledger versions 1..N all confirmed by the
engine, finite losses and gradients, and the trainer's log-probs of each step's tokens equal to the
engine's, so the engine served exactly the weights the offloaded trainer exported. Skipped
without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.e2e import Workspace, check_run, jsonl, tether

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROLLOUTS = 2


def one_gpu_flags(ws: Workspace, run: Path, *extra: str) -> list[str]:
    """The CPU runs' flags on a GPU plan: no --cpu-devices, one device for the actor and the engine."""
    flags = ws.flags(run, *extra)
    at = flags.index("--cpu-devices")
    del flags[at : at + 2]
    flags[flags.index("--actor-num-gpus-per-node") + 1] = "1"
    flags[flags.index("--rollout-num-gpus") + 1] = "1"
    return flags


@pytest.mark.parametrize(
    ("precision", "extra", "logprob_tol"),
    [
        # float32 on both sides (the engine's auto would be float16): the log-probs agree to 1e-4.
        ("fp32", ["--sglang-dtype", "float32"], 1e-4),
        # bfloat16 on both sides, computed by different kernels: rounding-level agreement only.
        ("bf16", ["--bf16", "--sglang-dtype", "bfloat16"], 0.1),
    ],
)
def test_colocated_run_shares_one_gpu(
    ws: Workspace, run_dir: Path, precision: str, extra: list[str], logprob_tol: float
) -> None:
    flags = one_gpu_flags(
        ws, run_dir, "--num-rollout", str(ROLLOUTS), "--colocate", "--offload-train", *extra
    )
    tether("run", *flags, timeout=600)
    check_run(run_dir, transport="tensor", steps=ROLLOUTS, logprob_tol=logprob_tol)
    receipt = __import__("json").loads((run_dir / "receipt.json").read_text())
    plan = receipt["plan"]
    assert plan["device_kind"] == "gpu" and plan["colocate"] and plan["offload_train"]
    actor = plan["train_groups"][0]["nodes"][0]
    assert actor["devices"] == plan["engines"][0]["parts"][0]["devices"]  # one GPU, shared
    events = [e["event"] for e in jsonl(run_dir / "events.jsonl")]
    # The engine released its weights at launch: they were restored (as version 0) before rollout 0.
    assert events.count("weights_restored") == 1
    assert events.index("weights_restored") < events.index("ready")

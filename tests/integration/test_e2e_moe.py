"""`tether run` end to end on CPU with Mixture-of-Experts models: a tiny qwen3_moe, a tiny
deepseek_v3-style model (multi-latent attention + MoE with shared experts and grouped routing)
a tiny minimax_m2 (QK norms over all heads, partial RoPE, biased sigmoid routing) and a tiny
Qwen3.5-MoE as published (a vision-language checkpoint with fused experts; gated-DeltaNet linear
attention split over TP, its output norm sequence-parallel), a tiny Qwen3-Next at DP=2 (its
grouped in_proj_qkvz/in_proj_ba regrouped into Megatron's in_proj and back for the engine) and
a tiny dense Qwen3.5 (its linear attention without experts), and
tiny GLM-5 and DeepSeek-V3.2 (DeepSeek sparse attention: each query attends to the 4 keys its
indexer chooses, in the trainer's full-sequence forward and the engine's prefill and decode alike),
trained through Megatron with distributed weight sync to the CPU engine (qwen3_moe in slime's MoE
layout: TP=2 with its experts at ETP=1, split by EP=2). At every step the
engine's log-probs of the sampled tokens equal the trainer's (check_run), so the engine serves
exactly the MoE weights the trainer exported — every expert, router, correction bias, QK norm
and MLA projection.
Routing replay through a whole run: tests/integration/test_e2e_routing_replay.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e import STEPS, check_run, jsonl, make_workspace, tether

from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec

# qwen3_moe in slime's MoE layout: TP=2 (sequence parallel) with the experts at ETP=1, split over
# the two ranks by EP=2; the others at DP=2.
ETP1 = (
    *("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    *("--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"),
    *("--moe-token-dispatcher-type", "alltoall"),
)
LAYOUT = {
    "qwen3_moe": ETP1,
    "deepseek_v3": (),
    "minimax_m2": (),
    "qwen3_5_moe": ETP1,
    "qwen3_next": (),
    "glm_moe_dsa": (),
    "deepseek_v32": (),
    "qwen3_5": (),  # dense, beside its MoE form: the same linear attention, an MLP instead of experts
}


@pytest.mark.parametrize("arch", list(LAYOUT))
def test_moe_model_trains_with_distributed_sync(tmp_path: Path, run_dir: Path, arch: str) -> None:
    # The sparse-attention models: GLM-5 with two indexer layers and two sharing their choice.
    layers = 4 if arch == "glm_moe_dsa" else 2
    spec = TinyModelSpec(arch=arch, bpe_merges=0, layers=layers)  # type: ignore[arg-type]
    ws = make_workspace(tmp_path / "ws", spec)
    flags = ["--num-rollout", str(STEPS), "--update-weight-transport", "nccl", *LAYOUT[arch]]
    tether("run", *ws.flags(run_dir, *flags), timeout=600)
    metrics = check_run(run_dir, transport="distributed")
    assert all(m["rollout/version_lag_max"] == 0 for m in metrics)
    assert [e["event"] for e in jsonl(run_dir / "events.jsonl")][-1] == "finished"

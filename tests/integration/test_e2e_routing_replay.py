"""`tether run` on CPU with a tiny qwen3_moe and MoE routing replay: with --use-rollout-routing-replay
every trained sample carries the experts the CPU engine routed each of its tokens to (the rollout
asked for them; the trainer replayed them, or its consumed-exactly-once check would have failed the
step); with --use-routing-replay the trainer records the routing in each step's log-prob pass and
replays it in the step. Both flags are refused for a dense model before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.e2e import STEPS, check_run, make_workspace, tether

from tether.rollout.config import moe_routing
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec
from tether.rollout.debug_dump import load_rollout

FLAGS = {"r2": "--use-routing-replay", "r3": "--use-rollout-routing-replay"}


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_moe_run_replays_routing(tmp_path: Path, run_dir: Path, mode: str) -> None:
    ws = make_workspace(tmp_path / "ws", TinyModelSpec(arch="qwen3_moe", bpe_merges=0))
    dump = tmp_path / "rollout-{rollout_id}.msgpack"
    flags = [
        "--num-rollout",
        str(STEPS),
        "--update-weight-transport",
        "nccl",
        "--save-debug-rollout-data",
        str(dump),
    ]
    tether("run", *ws.flags(run_dir, *flags, FLAGS[mode]), timeout=600)
    check_run(run_dir, transport="distributed")
    algorithm = json.loads((run_dir / "receipt.json").read_text())["config"]["algorithm"]
    assert algorithm["use_routing_replay"] is True  # R3 implies R2, as in slime
    assert algorithm["use_rollout_routing_replay"] is (mode == "r3")
    shape = moe_routing(str(ws.model))
    assert shape is not None
    for rollout_id in range(STEPS):
        samples = [s for group in load_rollout(str(dump), rollout_id).groups for s in group]
        for s in samples:
            routed = s.rollout_routed_experts
            if mode == "r2":
                assert routed is None  # the engines are not asked: the trainer records its own
                continue
            assert routed is not None, s.index
            assert (routed.rows, routed.layers, routed.topk) == (len(s.tokens) - 1, shape.layers, shape.topk)
            experts = routed.array()
            assert experts.min() >= 0 and experts.max() < shape.experts
            assert all(len(set(row)) == routed.topk for row in experts.reshape(-1, routed.topk).tolist())
            assert np.unique(experts).size > 1  # real routing, not a constant


@pytest.mark.parametrize("flag", FLAGS.values())
def test_a_dense_model_is_refused_at_plan_time(tmp_path: Path, run_dir: Path, flag: str) -> None:
    ws = make_workspace(tmp_path / "ws")  # a tiny dense Llama
    done = tether("plan", *ws.flags(run_dir, flag), check=False)
    assert done.returncode != 0
    assert f"{flag}=True: replays Mixture-of-Experts routing" in done.stdout + done.stderr
    assert not run_dir.exists()

"""Shared pieces of the end-to-end tests: a tiny model, prompts, a reward with spread, a runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether import demo_task
from tether.rollout.tiny_model import TinyModelSpec, write_tiny_model

HERE = Path(__file__).resolve().parent


async def spread_reward(args: Any, sample: Any) -> float:
    """A reward that differs between samples of one group, so every step has a gradient."""
    return float(sum(sample.tokens[-sample.response_length :]) % 5) / 4.0


@dataclass
class Workspace:
    root: Path
    model: Path
    train: Path
    eval: Path

    def flags(self, run_dir: Path, *extra: str) -> list[str]:
        return [
            "--hf-checkpoint",
            str(self.model),
            "--prompt-data",
            str(self.train),
            "--input-key",
            "prompt",
            "--label-key",
            "label",
            "--custom-rm-path",
            f"{HERE / 'e2e_support.py'}:spread_reward",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "4",
            "--rollout-max-response-len",
            "6",
            "--cpu-devices",
            "3",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "1",
            "--rollout-engine",
            "cpu",
            "--lr",
            "1e-3",
            "--use-dynamic-batch-size",
            "--max-tokens-per-gpu",
            "4096",
            "--rollout-health-check-first-wait",
            "120",
            "--run-dir",
            str(run_dir),
            "--progress",
            "plain",
            *extra,
        ]


def make_workspace(root: Path) -> Workspace:
    model = write_tiny_model(
        root / "model", TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, bpe_merges=0)
    )
    train, held = demo_task.split()
    demo_task.write_jsonl(root / "train.jsonl", train[:256])
    demo_task.write_jsonl(root / "eval.jsonl", held[:16])
    return Workspace(root, model, root / "train.jsonl", root / "eval.jsonl")


def tether(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`tether ARGS` as a real process; on failure the output says why."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tether", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"tether {args[0]} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

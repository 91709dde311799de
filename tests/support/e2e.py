"""Shared pieces of the end-to-end tests: a tiny model, prompts, a reward with spread, a runner."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.commands import demo_task
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

HERE = Path(__file__).resolve().parent
STEPS = 3


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
            f"{HERE / 'e2e.py'}:spread_reward",
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


def make_workspace(root: Path, spec: TinyModelSpec | None = None) -> Workspace:
    model = write_tiny_model(
        root / "model", spec or TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, bpe_merges=0)
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


def check_clean_exit(run: Path) -> None:
    """A run that ended normally looks clean: no error file in logs/, and every process it
    started exited 0, not by a signal (each trainer job and engine has its exit recorded); the
    trainer jobs by themselves, after the head asked their ranks to exit."""
    logs = run / "logs"
    assert sorted(p.name for p in logs.glob("*error*.json")) == []
    exits = {e["name"]: e for e in jsonl(run / "events.jsonl") if e["event"] == "process_exit"}
    for record in exits.values():
        assert (record["returncode"], record["signal"], record["expected"]) == (0, None, True), record
    started = {p.stem for p in logs.glob("*.log") if p.stem.startswith(("trainer-node", "engine"))}
    assert started and started <= set(exits), (started, exits)
    for name in started:
        if name.startswith("trainer-node"):
            assert exits[name]["stopped_by"] == "request", exits[name]


def wait_for(
    what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 150.0
) -> None:
    """Poll `check` (files the run writes) until true; fail at once if the run exits first."""
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling a file another process writes; the condition is the sync


def check_run(run: Path, *, transport: str, steps: int = STEPS, logprob_tol: float = 1e-4) -> list[dict]:
    """What every finished run must show; `logprob_tol` bounds the trainer's and the engine's
    log-prob difference on samples of the current weights (float32 on both sides by default)."""
    ledger = jsonl(run / "ledger.jsonl")
    assert [e["version"] for e in ledger] == list(range(1, steps + 1))
    for entry in ledger:
        assert entry["ok"] and entry["transport"] == transport
        assert set(entry["engine_versions"].values()) == {entry["version"]}
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m["step"] >= 0]
    assert [m["step"] for m in metrics] == list(range(steps))
    for m in metrics:
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"])
        assert m["train/grad_norm"] > 0  # the spread reward gives every step a gradient
        assert m["rollout/samples"] == 16
    events = [e["event"] for e in jsonl(run / "events.jsonl")]
    assert events[0] == "start" and events[-1] == "finished"
    if "rollout_started_early" in events:  # generated while the trainers started: before the loop
        assert events.count("rollout_started_early") == 1
        assert events.index("rollout_started_early") < events.index("ready")
    # On samples made with the trainer's current weights (no version lag) the trainer's
    # log-probs equal the engine's on the same tokens: the engine serves exactly the weights the
    # trainer exported, from every shard and stage. Lagging samples (async) differ by design.
    on_policy = [m for m in metrics if m["rollout/version_lag_max"] == 0]
    assert on_policy and all(m["train/train_rollout_logprob_abs_diff"] < logprob_tol for m in on_policy)
    check_clean_exit(run)
    return metrics

"""Metrics go to metrics.jsonl and, when asked, to a Prometheus endpoint on the head (TensorBoard and
W&B offline, whose client starts a service process: tests/integration/test_head_metrics_wandb.py)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tether.metrics import MetricsSink
from tether.run_dir import RunDir, read_jsonl


def test_jsonl_and_prometheus(tmp_path: Path, free_port: int) -> None:
    run = RunDir(tmp_path / "run")
    port = free_port
    sink = MetricsSink(run, metrics_port=port)
    try:
        sink.log(0, {"rollout/reward_mean": 0.25, "train/loss": 1.5, "note": "text is kept in the file"})
        sink.log(1, {"rollout/reward_mean": 0.5, "train/loss": float("nan")})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        sink.close()
    assert "tether_rollout_reward_mean 0.5" in text and "tether_step 1.0" in text
    assert "tether_train_loss 1.5" in text  # a NaN is not exported; the last finite value stays
    records = read_jsonl(run.metrics_path)
    assert [r["step"] for r in records] == [0, 1] and records[0]["note"] == "text is kept in the file"


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.metric({"step": 0, "x": 1.0})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 1, "x"')  # a crash mid-append
    records = read_jsonl(run.metrics_path)
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["x"] == 1.0

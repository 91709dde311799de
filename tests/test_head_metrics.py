"""Metrics go to metrics.jsonl and, when asked, to a Prometheus endpoint on the head."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from tether.metrics import MetricsSink
from tether.run_dir import RunDir, read_jsonl


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_jsonl_and_prometheus(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    port = free_port()
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


def test_tensorboard_and_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(tmp_path / "run")
    sink = MetricsSink(
        run, use_tensorboard=True, use_wandb=True, wandb_project="tether-test", config={"lr": 1e-3}
    )
    try:
        for step in range(3):
            sink.log(step, {"rollout/reward_mean": 0.1 * step})
    finally:
        sink.close()
    events = list((run.path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    offline = list((run.path / "wandb").glob("offline-run-*"))
    assert offline and list(offline[0].glob("*.wandb"))

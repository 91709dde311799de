"""Metrics to TensorBoard and to W&B offline (W&B's client starts its wandb-core service process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.records.metrics import MetricsSink
from tether.records.run_dir import RunDir


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

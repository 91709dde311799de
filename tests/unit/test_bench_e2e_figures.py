"""`tether bench e2e`'s figures: the arithmetic on a made-up run directory (steady window, busy
fractions, version lag, ratios) and a missing event named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.bench.e2e import RATIO_KEYS, ratios, summarise


def _write_run(run: Path, *, lag: float) -> None:
    run.mkdir(parents=True)
    events = [
        {"time": 100.0, "event": "start"},
        {"time": 110.0, "event": "ready", "engine_busy_s_total": 1.0},
        {"time": 120.0, "event": "loop_done", "engine_busy_s_total": 7.0},
        {"time": 121.0, "event": "finished"},
    ]
    metrics = [{"step": -1, "time": 109.0, "eval/reward_mean": 0.0}] + [
        {
            "step": step,
            "time": 112.0 + 4 * step,
            "rollout/samples": 16,
            "rollout/version_lag_mean": 0.0 if step == 0 else lag,
            "rollout/version_lag_max": 0.0 if step == 0 else lag,
            "train/time_s": 1.0,
            "sync/time_s": 0.5,
        }
        for step in range(3)
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "receipt.json").write_text(json.dumps({"plan": {"engines": [{}, {}]}}))


def test_summarise_takes_the_steady_window(tmp_path: Path) -> None:
    _write_run(tmp_path / "sync", lag=0.0)
    _write_run(tmp_path / "async", lag=1.0)
    sync, lagged = summarise(tmp_path / "sync"), summarise(tmp_path / "async")
    assert sync["wall_s"] == 10.0 and sync["startup_s"] == 10.0 and sync["shutdown_s"] == 1.0
    assert sync["samples"] == 48 and sync["samples_per_s"] == 4.8  # the eval record (-1) is no step
    assert sync["trainer_busy_fraction"] == 0.45  # (3 x 1.0 + 3 x 0.5) / 10
    assert sync["engine_busy_fraction"] == 0.3  # (7 - 1) / (2 engines x 10 s)
    assert sync["version_lag_mean"] == 0.0 and sync["sync_time_mean_s"] == 0.5
    assert (
        lagged["version_lag_mean"] == round(2 / 3, 4) and lagged["version_lag_mean_after_first_step"] == 1.0
    )
    assert ratios({"sync": sync, "async": lagged}) == {"async": dict.fromkeys(RATIO_KEYS, 1.0)}


def test_summarise_names_a_missing_event(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", lag=0.0)
    events = tmp_path / "run" / "events.jsonl"
    events.write_text(
        "".join(line + "\n" for line in events.read_text().splitlines() if "loop_done" not in line)
    )
    with pytest.raises(ValueError, match="loop_done"):
        summarise(tmp_path / "run")

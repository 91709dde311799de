"""`tether bench e2e`: a real short bench of all three loops (the figures' arithmetic on a made-up
run: tests/unit/test_bench_e2e_figures.py)."""

from __future__ import annotations

import json
from pathlib import Path

from support.e2e import tether

from tether.bench.e2e import MODES, RATIO_KEYS

FRACTIONS = ("trainer_busy_fraction", "engine_busy_fraction")


def test_bench_e2e_json_all_three_loops(tmp_path: Path) -> None:
    steps = 3
    done = tether("bench", "e2e", "--steps", str(steps), "--json", "--out", str(tmp_path), timeout=900)
    result = json.loads(done.stdout)
    assert result == json.loads((tmp_path / "bench_e2e.json").read_text())
    assert result["benchmark"] == "e2e" and result["setup"]["steps"] == steps
    assert list(result["modes"]) == list(MODES)
    assert set(result["ratio_vs_sync"]) == {"async", "fully-async"}
    for mode, figures in result["modes"].items():
        assert figures["steps"] == steps and figures["samples"] == steps * 16 * 8, mode
        assert figures["wall_s"] > 0 and figures["samples_per_s"] > 0, mode
        for key in FRACTIONS:
            assert 0.0 < figures[key] <= 1.0, (mode, key, figures[key])
        assert figures["sync_time_mean_s"] > 0, mode
        assert Path(figures["run_dir"], "metrics.jsonl").exists()
    for mode, ratio in result["ratio_vs_sync"].items():
        assert set(ratio) == set(RATIO_KEYS)
        assert all(v is not None and v > 0 for v in ratio.values()), (mode, ratio)
    modes = result["modes"]
    assert modes["sync"]["version_lag_mean"] == 0.0 and modes["sync"]["version_lag_max"] == 0.0
    # async: rollout N+1 is made on the weights before step N's sync, so every later step lags one version
    assert modes["async"]["version_lag_mean_after_first_step"] == 1.0
    assert modes["fully-async"]["version_lag_mean_after_first_step"] > 0.0

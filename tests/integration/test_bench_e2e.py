"""`tether bench e2e`: a real short bench of all three loops (the figures' arithmetic on a made-up
run: tests/unit/test_bench_e2e_figures.py)."""

from __future__ import annotations

import json
from pathlib import Path

from support.e2e import tether

from tether.bench.e2e.bench import MODES, RATIO_KEYS

FRACTIONS = ("trainer_busy_fraction", "engine_busy_fraction")


def test_bench_e2e_json_all_three_loops(tmp_path: Path) -> None:
    steps = 3
    done = tether(
        "bench",
        "e2e",
        "--steps",
        str(steps),
        "--startup-pairs",
        "1",
        "--json",
        "--out",
        str(tmp_path),
        timeout=900,
    )
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
    for mode, figures in modes.items():  # the step's split and the time to the first step
        assert 0 < figures["first_step_s"] and figures["startup_s"] < figures["first_step_s"], mode
        assert figures["first_step_s"] < figures["first_step_done_s"], mode
        assert figures["cpu_s"] > 0 and figures["step_time_median_s"] > 0, mode
        assert figures["rollout_wait_mean_s"] >= 0 and figures["train_time_mean_s"] > 0, mode
    # the sync loop's phases run one after the other: together they are (nearly) the whole step
    sync = modes["sync"]
    split = sync["rollout_wait_mean_s"] + sync["train_time_mean_s"] + sync["sync_time_mean_s"]
    rest = sync["other_time_mean_s"] - sync["overlap_time_mean_s"]
    assert abs(sync["step_time_mean_s"] - split - rest) < 1e-3
    assert sync["other_time_mean_s"] < 0.5 * sync["step_time_mean_s"]
    single = result["single_process"]  # the same-run baseline: one process, same model and recipe
    assert single["steps"] == steps and single["threads"] == 1 and single["cpu_s"] > 0
    assert single["step_time_median_s"] > 0 and single["first_step_s"] > 0
    goals = result["targets"]
    assert goals["step_median_vs_single_process"]["value"] == round(
        sync["step_time_median_s"] / single["step_time_median_s"], 3
    )
    first = goals["first_step_vs_single_process"]
    assert (first["tether_s"], first["single_process_s"]) == (sync["first_step_s"], single["first_step_s"])
    assert first["value"] == round(sync["first_step_s"] / single["first_step_s"], 3)
    assert modes["sync"]["version_lag_mean"] == 0.0 and modes["sync"]["version_lag_max"] == 0.0
    # async: rollout N+1 is made on the weights before step N's sync, so every later step lags one version
    assert modes["async"]["version_lag_mean_after_first_step"] == 1.0
    assert modes["fully-async"]["version_lag_mean_after_first_step"] > 0.0
    # one start-up pair: a one-step sync run (first, as pair 0 goes) and a one-step baseline
    (pair,) = result["startup_pairs"]
    assert pair["first"] == "tether" and pair["tether_s"] > 0 and pair["single_process_s"] > 0
    pair_dir = tmp_path / "startup" / "pair0"
    records = (pair_dir / "sync" / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum(1 for line in records if json.loads(line).get("step", -1) >= 0) == 1
    assert (pair_dir / "single_process.log").exists()
    paired = goals["first_step_vs_single_process_paired"]
    assert paired["pairs"] == 1 and paired["value"] == round(pair["tether_s"] / pair["single_process_s"], 3)

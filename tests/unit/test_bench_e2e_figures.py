"""`tether bench e2e`'s figures: the arithmetic on a made-up run directory (steady window, busy
fractions, version lag, ratios) and a missing event named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.bench.e2e.bench import (
    RATIO_KEYS,
    add_arguments,
    from_launch,
    main,
    pair_order,
    paired_startup,
    ratios,
    summarise,
    table,
    targets,
)
from tether.runtime.errors import ConfigError

SETUP = {  # what `table` reads of a result's setup
    "steps": 3,
    "prompts": 16,
    "samples_per_prompt": 8,
    "update_weight_mode": "full",
    "update_weight_transport": "disk",
    "machine": "load 1.0/1.0 on 2 cores",
    "baseline": "one process",
}


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


def test_summarise_splits_the_step_and_times_the_first_one(tmp_path: Path) -> None:
    _write_run(tmp_path / "run", lag=0.0)
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record, step_s in zip(records[1:], (3.0, 5.0, 4.0), strict=True):
        record.update({"rollout/wait_s": 2.0, "perf/step_s": step_s})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = summarise(tmp_path / "run", launched=97.5)
    assert figures["first_step_s"] == 12.5  # launch (97.5) to the "ready" event (110)
    assert figures["first_step_done_s"] == 14.5  # launch to step 0's metrics record (112)
    assert figures["step_time_median_s"] == 4.0 and figures["step_time_mean_s"] == round(10 / 3, 4)
    # each step: 2.0 waiting for the rollout + 1.0 train + 0.5 sync = 3.5 s, more than the 10/3 s
    # step: the phases overlapped by the difference, and nothing is left for "other"
    assert figures["rollout_wait_mean_s"] == 2.0
    assert figures["other_time_mean_s"] == 0.0
    assert figures["overlap_time_mean_s"] == round(3.5 - 10 / 3, 4)
    assert summarise(tmp_path / "run")["first_step_s"] is None  # no launch time, no figure


def test_targets_beside_the_single_process_baseline() -> None:
    single = {"step_time_median_s": 0.2, "first_step_s": 5.0}
    met = targets({"first_step_s": 3.5, "step_time_median_s": 0.19}, single)
    assert met["first_step_vs_single_process"] == {
        "value": 0.7,
        "tether_s": 3.5,
        "single_process_s": 5.0,
        "target": 1.0,
        "met": True,
    }
    assert met["step_median_vs_single_process"]["value"] == 0.95
    assert met["step_median_vs_single_process"]["met"] is True
    missed = targets({"first_step_s": 8.3, "step_time_median_s": 0.245}, single)
    assert missed["first_step_vs_single_process"]["value"] == 1.66
    assert missed["first_step_vs_single_process"]["met"] is False
    assert missed["step_median_vs_single_process"] == {
        "value": 1.225,
        "tether_s": 0.245,
        "single_process_s": 0.2,
        "target": 1.0,
        "met": False,
    }


def test_table_prints_the_baseline_and_the_targets(tmp_path: Path) -> None:
    _write_run(tmp_path / "sync", lag=0.0)
    _write_run(tmp_path / "async", lag=1.0)
    modes = {m: summarise(tmp_path / m, launched=100.0, cpu_s=30.0) for m in ("sync", "async")}
    modes["sync"]["step_time_median_s"] = 0.5
    single = {
        "step_time_median_s": 0.25,
        "rollout_time_mean_s": 0.1,
        "train_time_mean_s": 0.15,
        "first_step_s": 5.0,
        "first_step_done_s": 5.25,
        "cpu_s": 9.0,
    }
    result = {
        "setup": SETUP,
        "modes": modes,
        "ratio_vs_sync": ratios(modes),
        "single_process": single,
        "targets": targets(modes["sync"], single),
    }
    lines = table(result).splitlines()
    assert next(line for line in lines if line.startswith("launch to first step s")).split()[-2:] == [
        "10",
        "10",
    ]
    done = next(line for line in lines if line.startswith("launch to first step done s"))
    assert done.split()[-2:] == ["12", "12"]  # to step 0's record (112), launched at 100
    assert next(line for line in lines if line.startswith("median step s")).split()[-2:] == ["0.5", "n/a"]
    assert (
        "median step 0.25 s (rollout 0.1 s + train 0.15 s), launch to first step 5.0 s (done 5.25 s), "
        "CPU 9.0 s" in lines[-3]
    )
    assert lines[-2].endswith("first step / single process 2.0 <= 1.0: NOT met")
    assert lines[-1].endswith("median step / single process 2.0 <= 1.0: NOT met")


def test_the_baseline_is_timed_from_its_launch_as_a_run_is() -> None:
    """The single process reports its first step's wall-clock start; the figure counts from the
    moment `bench e2e` launched it (interpreter start included, as for `tether run`)."""
    own = {"first_step_s": 2.0, "first_step_done_s": 2.25, "first_step_at": 1000.5, "steps": 4}
    figures = from_launch(own, launched=998.0)
    assert figures["first_step_s"] == 2.5 and figures["first_step_done_s"] == 2.75
    assert figures["first_step_from_module_s"] == 2.0 and "first_step_at" not in figures


def test_startup_pairs_alternate_and_take_the_median_of_each_pairs_ratio() -> None:
    """Which side of a pair starts first alternates; the paired figure is the median of the
    pairs' own ratios, which a ratio of the two sides' medians is not."""
    assert [pair_order(i)[0] for i in range(4)] == ["tether", "single_process"] * 2
    assert all(sorted(pair_order(i)) == ["single_process", "tether"] for i in range(4))
    # a slow minute (pair 1) slows both sides: the pair's ratio stays what the others say
    pairs = [
        {"tether_s": 3.0, "single_process_s": 3.2},
        {"tether_s": 6.6, "single_process_s": 6.0},
        {"tether_s": 2.7, "single_process_s": 3.0},
    ]
    got = paired_startup(pairs)
    assert got == {"value": 0.938, "pairs": 3, "ratios": [0.938, 1.1, 0.9], "target": 1.0, "met": True}
    missed = paired_startup(pairs[1:2])
    assert missed["value"] == 1.1 and missed["met"] is False


def test_the_paired_target_is_printed_when_measured(tmp_path: Path) -> None:
    _write_run(tmp_path / "sync", lag=0.0)
    modes = {"sync": summarise(tmp_path / "sync", launched=100.0, cpu_s=30.0)}
    single = {
        "step_time_median_s": 0.25,
        "rollout_time_mean_s": 0.1,
        "train_time_mean_s": 0.15,
        "first_step_s": 5.0,
        "cpu_s": 9.0,
    }
    goals = targets(modes["sync"], single)
    goals["first_step_vs_single_process_paired"] = paired_startup(
        [{"tether_s": 2.0, "single_process_s": 2.5}, {"tether_s": 3.0, "single_process_s": 2.5}]
    )
    result = {"setup": SETUP, "modes": modes, "ratio_vs_sync": {}, "single_process": single, "targets": goals}
    assert (
        table(result)
        .splitlines()[-1]
        .endswith("median of 2 alternating pairs 1.0 (pairs [0.8, 1.2]) <= 1.0: met")
    )


def test_a_negative_pair_count_is_refused_by_name() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="--startup-pairs"):
        main(parser.parse_args(["--startup-pairs", "-1"]))


def test_startup_pairs_run_one_step_each_in_their_own_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pairs' wiring (the runs themselves are `run_mode` and `run_baseline`, which the
    three loops and the baseline of tests/integration/test_bench_e2e.py run for real)."""
    import argparse

    import tether.bench.e2e.bench as e2e

    calls: list[tuple[str, int, Path]] = []
    clock = iter([4.0, 5.0, 6.0, 5.0])  # pair 0: tether 4 s, baseline 5 s; pair 1: baseline 6, tether 5

    def run_mode(
        args: argparse.Namespace, mode: str, out: Path, model: Path, mode_dir: Path
    ) -> tuple[Path, float, float]:
        calls.append((mode, args.steps, mode_dir))
        return mode_dir / "run", 0.0, 1.0

    def run_baseline(args: argparse.Namespace, out: Path, model: Path, prompts: Path) -> dict[str, float]:
        calls.append(("baseline", args.steps, out))
        return {"first_step_s": next(clock)}

    monkeypatch.setattr(e2e, "run_mode", run_mode)
    monkeypatch.setattr(e2e, "run_baseline", run_baseline)
    monkeypatch.setattr(e2e, "summarise", lambda run_dir, launched, cpu_s: {"first_step_s": next(clock)})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--steps", "20", "--startup-pairs", "2"])
    pairs = e2e.startup_pairs(args, tmp_path, tmp_path / "model", tmp_path / "train.jsonl")
    assert calls == [
        ("sync", 1, tmp_path / "startup" / "pair0" / "sync"),
        ("baseline", 1, tmp_path / "startup" / "pair0"),
        ("baseline", 1, tmp_path / "startup" / "pair1"),
        ("sync", 1, tmp_path / "startup" / "pair1" / "sync"),
    ]
    assert pairs == [
        {"first": "tether", "tether_s": 4.0, "single_process_s": 5.0},
        {"first": "single_process", "single_process_s": 6.0, "tether_s": 5.0},
    ]
    assert args.steps == 20  # the loops' own runs keep theirs
    # a pair's run keeps its files in its own directory, and reads the bench's prompts
    argv = e2e.run_argv(args, "sync", tmp_path, tmp_path / "model", tmp_path / "startup" / "pair0" / "sync")
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path / "startup" / "pair0" / "sync" / "run")
    assert argv[argv.index("--prompt-data") + 1] == str(tmp_path / "train.jsonl")

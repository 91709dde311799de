"""`tether bench e2e`: one short demo-sized run in each loop mode, side by side.

The three runs (sync, async, fully-async) go one after another through `tether run` with the
same model (the demo's tiny Llama), prompts, seed, step count, batch and weight-sync transport,
so the only difference is the loop. Per mode, over the steady part of the run (from the job's
"ready" event to its "loop_done" event: engine and trainer start-up and shut-down excluded):

  samples_per_s           samples trained / wall seconds
  trainer_busy_fraction   (sum of train/time_s + sync/time_s) / wall seconds
  engine_busy_fraction    engine seconds with >= 1 request in flight / (engines x wall seconds)
  version_lag_mean        mean over trained samples of (trained version - oldest generating version)
  sync_time_mean_s        mean weight-sync seconds per step

and each step's split: `rollout_wait_mean_s` (the loop waiting for its rollout), `train_time_mean_s`,
`sync_time_mean_s` and `other_time_mean_s` (the rest of the step: hand-over, records, evaluation;
`overlap_time_mean_s` where the async loops ran phases at once, so they sum to more than the step);
`step_time_median_s` (the loop's own per-step seconds) and `first_step_s`, seconds from launching
`tether run` to its first step (the "ready" event: imports, engines, trainer ranks, models built),
and `first_step_done_s`, to the end of that step (its metrics record: a first rollout that
generated while the trainer ranks started shortens this one, not `first_step_s`).
Each mode and the baseline also carry `load_1m`, the machine's 1-minute load average before and
after its run: the ratios below hold for a quiet machine only when those are near 0.

Beside them, the same-run baselines: each figure's ratio against the sync loop measured in the
same invocation, and the demo's GRPO step in one plain-torch process on the same model, prompts,
seed and recipe (`tether.bench.e2e.single_process_grpo`), its first step too timed from the moment
this command launched it, with the targets (issue #37): launch to the first step no later than
the single process's, and the sync loop's median step no slower than the single process's.

One run of each says little about start-up on a machine whose speed drifts from one minute to
the next, so `--startup-pairs N` adds N alternating pairs after them, each a sync run of one
step and the baseline of one step (which goes first alternates from pair to pair), both timed
from launch to their first step; `first_step_vs_single_process_paired` is the median of the
pairs' ratios, each taken from two runs of the same minute.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tether.bench.bytecode import note_uncompiled
from tether.bench.compare import compare_table, with_comparison
from tether.commands import demo, demo_task
from tether.records.run_dir import read_jsonl
from tether.runtime.errors import ConfigError
from tether.runtime.files.atomic_file import write_bytes_atomic

MODES = ("sync", "async", "fully-async")
RATIO_KEYS = ("samples_per_s", "trainer_busy_fraction", "engine_busy_fraction", "sync_time_mean_s")
FIRST_STEP_VS_SINGLE_PROCESS_TARGET = 1.0  # launch to the first step over the single process's
STEP_VS_SINGLE_PROCESS_TARGET = 1.0  # the sync loop's median step over the single process's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON (a table otherwise).")
    parser.add_argument("--steps", type=int, default=20, help="Training steps per loop mode.")
    parser.add_argument("--prompts", type=int, default=16, help="Prompts per step.")
    parser.add_argument("--samples", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--seed", type=int, default=1, help="Seed for the model, data order and sampling.")
    demo.add_weight_sync_arguments(
        parser, "How weights reach the engine in every mode (nccl means gloo on CPU)."
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Keep the runs under this directory (default: a temporary one).",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=900.0, help="Seconds one mode's run may take before it fails."
    )
    parser.add_argument(
        "--baseline-threads",
        type=int,
        default=1,
        help="torch threads of the single-process baseline (1: as the issue's TRL comparison; on "
        "2 shared cores 2 threads measured ~10x slower per step under load).",
    )
    parser.add_argument(
        "--startup-pairs",
        type=int,
        default=0,
        help="Then this many alternating pairs of a one-step sync run and a one-step baseline, "
        "for a paired launch-to-first-step ratio (0: none).",
    )


def _positive(args: argparse.Namespace) -> None:
    for name in ("steps", "prompts", "samples", "baseline_threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be at least 1")
    if args.startup_pairs < 0:
        raise ConfigError("--startup-pairs", args.startup_pairs, "must be 0 or more")


def prepare(out: Path, seed: int) -> tuple[Path, Path]:
    """The demo's tiny model and training prompts; returns (model, prompts file)."""
    model = demo.make_model(out, seed)
    train, _ = demo_task.split(seed=123)
    prompts = out / "train.jsonl"
    demo_task.write_jsonl(prompts, train)
    return model, prompts


def run_argv(
    args: argparse.Namespace, mode: str, out: Path, model: Path, mode_dir: Path | None = None
) -> list[str]:
    """`tether run` flags for one mode; everything but --loop (and the paths) is the same in all.
    The run's own files go under `mode_dir` (default `out/mode`)."""
    common = argparse.Namespace(seed=args.seed, temperature=demo.Recipe().temperature, parallel="dp2")
    flags = demo.common_flags(common, out)
    flags[flags.index("--progress") + 1] = "plain"
    mode_dir = mode_dir or out / mode
    return [
        "--hf-checkpoint",
        str(model),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.samples),
        "--rollout-shuffle",
        "--rollout-seed",
        str(args.seed),
        "--num-rollout",
        str(args.steps),
        "--advantage-estimator",
        "grpo",
        "--lr",
        str(demo.Recipe().lr),
        "--lr-decay-style",
        "constant",
        "--loop",
        mode,
        "--update-weight-transport",
        args.update_weight_transport,
        "--update-weight-mode",
        args.update_weight_mode,
        "--update-weight-disk-dir",
        str(mode_dir / "weights"),
        "--update-weight-local-checkpoint-dir",
        str(mode_dir / "local_weights"),
        "--run-dir",
        str(mode_dir / "run"),
        # The same trainer work in every mode: the engine's log-probs are the old policy (the
        # off-policy loops need it, see the demo; the sync loop gets it too for a fair comparison).
        "--use-rollout-logprobs",
        *flags,
    ]


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_mode(
    args: argparse.Namespace, mode: str, out: Path, model: Path, mode_dir: Path | None = None
) -> tuple[Path, float, float]:
    """One `tether run` as its own process; returns its run directory, the launch time and the CPU
    seconds of all its processes (engines, trainer ranks, head: a figure the machine's other load
    changes far less than wall time). Its files go under `mode_dir` (default `out/mode`)."""
    mode_dir = mode_dir or out / mode
    argv = run_argv(args, mode, out, model, mode_dir)
    run_dir = mode_dir / "run"
    log_path = mode_dir / "tether-run.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        launched = time.time()  # the run's event times are wall-clock too
        cpu = _children_cpu_s()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "tether", "run", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=args.run_timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{mode}: tether run took over --run-timeout={args.run_timeout}s") from exc
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{mode}: tether run exited {done.returncode} (log {log_path}):\n{tail}")
    return run_dir, launched, _children_cpu_s() - cpu


def run_baseline(args: argparse.Namespace, out: Path, model: Path, prompts: Path) -> dict[str, Any]:
    """The single-process GRPO loop as its own process (its start-up counted like a run's); its
    log goes to `out/single_process.log`."""
    argv = [
        sys.executable,
        "-m",
        "tether.bench.e2e.single_process_grpo",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--prompts-per-step",
        str(args.prompts),
        "--samples",
        str(args.samples),
    ]
    threads = str(args.baseline_threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    cpu = _children_cpu_s()
    launched = time.time()  # as for a run: the interpreter's own start counts too
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.run_timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"single-process baseline took over --run-timeout={args.run_timeout}s") from exc
    (out / "single_process.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"single-process baseline exited {done.returncode}:\n{done.stderr[-4000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    figures["cpu_s"] = round(_children_cpu_s() - cpu, 2)
    return from_launch(figures, launched)


def from_launch(figures: dict[str, Any], launched: float) -> dict[str, Any]:
    """The baseline's first-step times from the moment it was launched, as a run's are (its own
    figures start after the interpreter and this package started: kept as `*_from_module_s`)."""
    at = float(figures.pop("first_step_at"))
    step = figures["first_step_done_s"] - figures["first_step_s"]
    figures["first_step_from_module_s"] = figures["first_step_s"]
    figures["first_step_s"] = round(at - launched, 3)
    figures["first_step_done_s"] = round(at - launched + step, 3)
    return figures


def _event(events: list[dict[str, Any]], kind: str, run_dir: Path) -> dict[str, Any]:
    found = [e for e in events if e.get("event") == kind]
    if not found:
        raise ValueError(f"{run_dir / 'events.jsonl'}: no {kind!r} event")
    return found[-1]


def summarise(run_dir: Path, launched: float | None = None, cpu_s: float | None = None) -> dict[str, Any]:
    """The figures of one finished run, from its events, metrics and receipt; `launched`: when its
    `tether run` started (wall clock), for the time to its first step; `cpu_s`: its processes' CPU
    seconds, start to end."""
    events = read_jsonl(run_dir / "events.jsonl")
    start, ready = _event(events, "start", run_dir), _event(events, "ready", run_dir)
    done, finished = _event(events, "loop_done", run_dir), _event(events, "finished", run_dir)
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("step", -1) >= 0]
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no step records")
    receipt = json.loads((run_dir / "receipt.json").read_text())
    engines = max(1, len(receipt["plan"]["engines"]))
    wall = float(done["time"]) - float(ready["time"])
    if wall <= 0:
        raise ValueError(f"{run_dir}: loop_done ({done['time']}) is not after ready ({ready['time']})")
    samples = [float(m.get("rollout/samples", 0.0)) for m in steps]
    total = sum(samples)
    lags = [float(m.get("rollout/version_lag_mean", 0.0)) for m in steps]
    syncs = [float(m["sync/time_s"]) for m in steps if "sync/time_s" in m]
    trains = [float(m.get("train/time_s", 0.0)) for m in steps]
    waits = [float(m.get("rollout/wait_s", 0.0)) for m in steps]
    step_seconds = [float(m["perf/step_s"]) for m in steps if "perf/step_s" in m]
    busy = float(done["engine_busy_s_total"]) - float(ready["engine_busy_s_total"])

    def weighted_lag(pairs: list[tuple[float, float]]) -> float:
        n = sum(s for s, _ in pairs)
        return sum(s * lag for s, lag in pairs) / n if n else 0.0

    pairs = list(zip(samples, lags, strict=True))
    step_mean = wall / len(steps)
    rollout_wait, train_mean = sum(waits) / len(steps), sum(trains) / len(trains)
    sync_mean = sum(syncs) / len(syncs) if syncs else 0.0
    first = float(ready["time"]) - launched if launched is not None else None
    first_done = float(steps[0]["time"]) - launched if launched is not None else None
    return {
        "steps": len(steps),
        "samples": total,
        "engines": engines,
        "startup_s": round(float(ready["time"]) - float(start["time"]), 3),
        "first_step_s": None if first is None else round(first, 3),
        "first_step_done_s": None if first_done is None else round(first_done, 3),
        "cpu_s": None if cpu_s is None else round(cpu_s, 2),
        "wall_s": round(wall, 3),
        "shutdown_s": round(float(finished["time"]) - float(done["time"]), 3),
        "samples_per_s": round(total / wall, 3),
        "trainer_busy_fraction": round((sum(trains) + sum(syncs)) / wall, 4),
        "engine_busy_fraction": round(busy / (engines * wall), 4),
        "version_lag_mean": round(weighted_lag(pairs), 4),
        "version_lag_mean_after_first_step": round(weighted_lag(pairs[1:]), 4),
        "version_lag_max": max(float(m.get("rollout/version_lag_max", 0.0)) for m in steps),
        "sync_time_mean_s": round(sync_mean, 4),
        "train_time_mean_s": round(train_mean, 4),
        "rollout_wait_mean_s": round(rollout_wait, 4),
        # The async loops run phases at once (the next rollout while a step trains): what the
        # phases sum to beyond the step is their overlap, not negative bookkeeping time.
        "other_time_mean_s": round(max(0.0, step_mean - rollout_wait - train_mean - sync_mean), 4),
        "overlap_time_mean_s": round(max(0.0, rollout_wait + train_mean + sync_mean - step_mean), 4),
        "step_time_mean_s": round(step_mean, 4),
        "step_time_median_s": round(statistics.median(step_seconds), 4) if step_seconds else None,
        "run_dir": str(run_dir),
    }


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each non-sync mode's figures over the sync loop's (None where the sync figure is 0)."""
    base = modes["sync"]
    return {
        mode: {key: (round(figures[key] / base[key], 3) if base[key] else None) for key in RATIO_KEYS}
        for mode, figures in modes.items()
        if mode != "sync"
    }


def targets(sync: dict[str, Any], baseline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue #37's two targets for the sync loop (the demo's), each a ratio to its same-run baseline."""
    first, first_single = sync.get("first_step_s"), baseline["first_step_s"]
    first_ratio = round(first / first_single, 3) if first is not None and first_single else None
    step, single = sync.get("step_time_median_s"), baseline["step_time_median_s"]
    ratio = round(step / single, 3) if step is not None and single else None
    return {
        "first_step_vs_single_process": {
            "value": first_ratio,
            "tether_s": first,
            "single_process_s": first_single,
            "target": FIRST_STEP_VS_SINGLE_PROCESS_TARGET,
            "met": first_ratio is not None and first_ratio <= FIRST_STEP_VS_SINGLE_PROCESS_TARGET,
        },
        "step_median_vs_single_process": {
            "value": ratio,
            "tether_s": step,
            "single_process_s": single,
            "target": STEP_VS_SINGLE_PROCESS_TARGET,
            "met": ratio is not None and ratio <= STEP_VS_SINGLE_PROCESS_TARGET,
        },
    }


def pair_order(index: int) -> tuple[str, str]:
    """Which of a start-up pair runs first: tether in even pairs, the baseline in odd ones, so
    that neither always starts on the machine the other has just warmed (or loaded)."""
    return ("tether", "single_process") if index % 2 == 0 else ("single_process", "tether")


def paired_startup(pairs: list[dict[str, float]]) -> dict[str, Any]:
    """The paired launch-to-first-step target from pairs of {"tether_s", "single_process_s"}:
    the median of each pair's ratio (two runs of the same minute), not a ratio of medians."""
    ratios = [p["tether_s"] / p["single_process_s"] for p in pairs]
    value = round(statistics.median(ratios), 3)
    return {
        "value": value,
        "pairs": len(pairs),
        "ratios": [round(r, 3) for r in ratios],
        "target": FIRST_STEP_VS_SINGLE_PROCESS_TARGET,
        "met": value <= FIRST_STEP_VS_SINGLE_PROCESS_TARGET,
    }


def startup_pairs(args: argparse.Namespace, out: Path, model: Path, prompts: Path) -> list[dict[str, Any]]:
    """`args.startup_pairs` alternating pairs of a one-step sync run and a one-step baseline,
    each in a directory of its own under `out/startup/`; their launch-to-first-step seconds."""
    one = argparse.Namespace(**{**vars(args), "steps": 1})
    pairs: list[dict[str, Any]] = []
    for index in range(args.startup_pairs):
        where = out / "startup" / f"pair{index}"
        where.mkdir(parents=True, exist_ok=True)
        pair: dict[str, Any] = {"first": pair_order(index)[0]}
        for side in pair_order(index):
            if side == "tether":
                run = run_mode(one, "sync", out, model, where / "sync")
                pair["tether_s"] = summarise(*run)["first_step_s"]
            else:
                pair["single_process_s"] = run_baseline(one, where, model, prompts)["first_step_s"]
        print(
            f"[bench e2e] start-up pair {index + 1}/{args.startup_pairs}: tether {pair['tether_s']} s, "
            f"single process {pair['single_process_s']} s",
            file=sys.stderr,
            flush=True,
        )
        pairs.append(pair)
    return pairs


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} on {os.cpu_count()} cores"


def bench(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    started = time.monotonic()
    model, prompts = prepare(out, args.seed)
    modes: dict[str, dict[str, Any]] = {}
    for mode in MODES:  # one after another: they share the cores
        print(
            f"[bench e2e] {mode}: {args.steps} steps x {args.prompts}x{args.samples} ...",
            file=sys.stderr,
            flush=True,
        )
        load = os.getloadavg()[0]
        modes[mode] = summarise(*run_mode(args, mode, out, model))
        # The machine's 1-minute load before and after: figures from a loaded machine are not a quiet one's.
        modes[mode]["load_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        print(
            f"[bench e2e] {mode}: {modes[mode]['samples_per_s']} samples/s over {modes[mode]['wall_s']}s",
            file=sys.stderr,
            flush=True,
        )
    print(f"[bench e2e] single-process baseline: {args.steps} steps ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    baseline = run_baseline(args, out, model, prompts)
    baseline["load_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    goals = targets(modes["sync"], baseline)
    pairs = startup_pairs(args, out, model, prompts)
    if pairs:
        goals["first_step_vs_single_process_paired"] = paired_startup(pairs)
    return note_uncompiled(
        {
            "benchmark": "e2e",
            "setup": {
                "steps": args.steps,
                "prompts": args.prompts,
                "samples_per_prompt": args.samples,
                "seed": args.seed,
                "update_weight_transport": args.update_weight_transport,
                "update_weight_mode": args.update_weight_mode,
                "model": "demo tiny llama (hidden 128, 2 layers, byte-level vocab)",
                "trainer": "Megatron-core DP=2 on CPU",
                "engines": "1 CPU engine",
                "machine": _load(),
                "baseline": f"one process, plain torch, {args.baseline_threads} thread(s): "
                "tether.bench.e2e.single_process_grpo",
            },
            "modes": modes,
            "ratio_vs_sync": ratios(modes),
            "single_process": baseline,
            "startup_pairs": pairs,
            "targets": goals,
            "seconds": round(time.monotonic() - started, 1),
        },
        "e2e",
    )


ROWS = (
    ("samples_per_s", "samples/s"),
    ("trainer_busy_fraction", "trainer busy fraction"),
    ("engine_busy_fraction", "engine busy fraction"),
    ("version_lag_mean", "mean version lag"),
    ("sync_time_mean_s", "mean sync s"),
    ("rollout_wait_mean_s", "mean rollout wait s"),
    ("train_time_mean_s", "mean train s"),
    ("other_time_mean_s", "mean other s"),
    ("overlap_time_mean_s", "mean phase overlap s"),
    ("step_time_mean_s", "mean step s"),
    ("step_time_median_s", "median step s"),
    ("wall_s", "steady wall s"),
    ("startup_s", "start-up s"),
    ("first_step_s", "launch to first step s"),
    ("first_step_done_s", "launch to first step done s"),
    ("cpu_s", "CPU s, whole run"),
)

RATIO_ROWS = tuple((key, f"{label} / sync") for key, label in ROWS if key in RATIO_KEYS)


def table(result: dict[str, Any]) -> str:
    modes = result["modes"]
    names = list(modes)
    width = max(len(label) for _, label in ROWS + RATIO_ROWS) + 2
    lines = [
        f"tether bench e2e: {result['setup']['steps']} steps x {result['setup']['prompts']}x"
        f"{result['setup']['samples_per_prompt']} samples, {result['setup']['update_weight_mode']} "
        f"{result['setup']['update_weight_transport']} sync ({result['setup']['machine']})",
        "".ljust(width) + "".join(n.rjust(14) for n in names),
    ]
    for key, label in ROWS:
        lines.append(label.ljust(width) + "".join(_cell(modes[n][key]) for n in names))
    for key, label in RATIO_ROWS:
        cells = ["1".rjust(14)] + [_cell(result["ratio_vs_sync"][n][key]) for n in names[1:]]
        lines.append(label.ljust(width) + "".join(cells))
    single, goals = result["single_process"], result["targets"]
    first, step = goals["first_step_vs_single_process"], goals["step_median_vs_single_process"]
    lines += [
        f"single process ({result['setup']['baseline']}): median step {single['step_time_median_s']} s "
        f"(rollout {single['rollout_time_mean_s']} s + train {single['train_time_mean_s']} s), "
        f"launch to first step {single['first_step_s']} s (done {single.get('first_step_done_s')} s), "
        f"CPU {single['cpu_s']} s, "
        f"load {single.get('load_1m')} (sync loop's: {modes['sync'].get('load_1m')})",
        f"target: sync loop launch to first step / single process {first['value']} <= {first['target']}: "
        f"{'met' if first['met'] else 'NOT met'}",
        f"target: sync loop median step / single process {step['value']} <= {step['target']}: "
        f"{'met' if step['met'] else 'NOT met'}",
    ]
    paired = goals.get("first_step_vs_single_process_paired")
    if paired is not None:
        lines.append(
            f"target: launch to first step / single process, median of {paired['pairs']} alternating "
            f"pairs {paired['value']} (pairs {paired['ratios']}) <= {paired['target']}: "
            f"{'met' if paired['met'] else 'NOT met'}"
        )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return ("n/a" if value is None else format(value, ".4g")).rjust(14)


def main(args: argparse.Namespace) -> int:
    _positive(args)  # a bad flag is the user's: one line from the CLI, not a failed run
    try:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            result = bench(args, args.out)
            write_bytes_atomic(args.out / "bench_e2e.json", json.dumps(result, indent=2).encode())
        else:
            with tempfile.TemporaryDirectory(prefix="tether-bench-e2e-") as tmp:
                result = bench(args, Path(tmp))
            for figures in result["modes"].values():
                figures.pop("run_dir")  # removed with the temporary directory
    except (RuntimeError, ValueError) as exc:  # a run that failed, or one that left no figures
        print(f"[bench e2e] failed: {exc}", file=sys.stderr, flush=True)
        return 1
    shown = with_comparison(result, args)
    if args.json:
        print(json.dumps(shown, indent=2), flush=True)
    else:
        print(table(result), flush=True)
        if "compare" in shown:
            print(compare_table(shown["compare"]), flush=True)
    return 0

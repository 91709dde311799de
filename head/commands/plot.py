"""`tether plot RUN_DIR`: PNG curves of a run's metrics (reward, eval reward, KL, entropy, ...)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tether.records.run_dir import live_metrics, read_jsonl
from tether.runtime.errors import UserError

# (title, [(metric key, label)]) per panel; keys follow what the run loop writes to metrics.jsonl.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("rollout/reward_mean", "rollout"), ("eval/reward_mean", "held-out eval")]),
    ("KL", [("train/kl", "KL to reference")]),
    ("entropy", [("train/entropy", "entropy")]),
    (
        "staleness",
        [("rollout/version_lag_mean", "mean version lag"), ("rollout/version_lag_max", "max version lag")],
    ),
    ("throughput", [("perf/samples_per_s", "samples/s")]),
    ("weight sync", [("sync/time_s", "sync seconds")]),
]


def plot_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Write reward.png (the headline curve) and curves.png (every panel); return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training nodes
    import matplotlib.pyplot as plt

    records = live_metrics(read_jsonl(run_dir / "metrics.jsonl"))
    if not records:
        raise SystemExit(f"tether plot: {run_dir / 'metrics.jsonl'} holds no metrics")
    out = out or run_dir
    out.mkdir(parents=True, exist_ok=True)

    def series(key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in records:
            if key in r and r[key] is not None and "step" in r:
                xs.append(float(r["step"]))
                ys.append(float(r[key]))
        return xs, ys

    written = []
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, lines) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for key, label in lines:
            xs, ys = series(key)
            if xs:
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=80)
    plt.close(fig)
    written.append(curves)

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in PANELS[0][1]:
        xs, ys = series(key)
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"reward — {run_dir.name}")
    fig.tight_layout()
    reward = out / "reward.png"
    fig.savefig(reward, dpi=80)
    plt.close(fig)
    written.append(reward)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory (holds metrics.jsonl).")
    parser.add_argument(
        "--out", type=Path, default=None, help="Where to write the PNGs (default: the run directory)."
    )


def main(args: argparse.Namespace) -> int:
    metrics = args.run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(
            f"{metrics}: no such file; RUN_DIR must be a run's directory "
            "(`tether run --run-dir`, default runs/<time>)"
        )
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0

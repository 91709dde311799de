"""Progress on a terminal (rich bars) or plain log lines when output is not a terminal.

rich is imported only for the bars: a run whose output is a file (SLURM, systemd, a benchmark)
starts its processes without that import (~12 ms of the head's start before them).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rich.progress import Progress


class RunProgress:
    """Steps of the run, and the current phase (rollout, train, sync) of each step."""

    def __init__(
        self, total_steps: int, first_step: int, mode: Literal["auto", "rich", "plain"] = "auto"
    ) -> None:
        use_rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self._started = time.monotonic()
        self._total = total_steps
        self._progress: Progress | None = None
        if use_rich:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=False),
            )
            self._steps = self._progress.add_task("steps", total=total_steps, completed=first_step, info="")
            self._phase = self._progress.add_task("phase", total=None, info="starting")
            self._progress.start()

    def set_total(self, total: int, done: int) -> None:
        self._total = total
        if self._progress is not None:
            self._progress.update(self._steps, total=total, completed=done)

    def phase(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._phase, info=text, description=text.split()[0])

    def step_done(self, step: int, metrics: dict[str, Any]) -> None:
        keys = ("rollout/reward_mean", "eval/reward_mean", "train/loss", "sync/time_s", "perf/step_s")
        shown = "  ".join(
            f"{k.split('/')[-1]}={metrics[k]:.3g}" for k in keys if isinstance(metrics.get(k), int | float)
        )
        if self._progress is not None:
            self._progress.update(self._steps, completed=step + 1, info=shown)
        else:
            elapsed = time.monotonic() - self._started
            print(f"[tether] step {step + 1}/{self._total} {elapsed:7.1f}s  {shown}", flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(f"[tether] {text}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

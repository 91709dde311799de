"""torch.profiler traces of one phase of a trainer rank, written whole into the run directory.

A phase's steps count from 0 on each rank; steps start..end-1 are traced (one warm-up step before
them when start > 0, as Megatron and slime schedule it), once. The trace is Chrome's JSON, gzipped,
named as torch's TensorBoard handler names it: `<worker>.<unix ms>.pt.trace.json.gz`.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from tether.runtime.files.atomic_file import fsync_path

log = logging.getLogger(__name__)


def traced_steps(start: int, end: int) -> range:
    """The steps (from 0) a trace covers."""
    return range(start, end)


def write_trace(prof: Any, out_dir: Path, worker: str) -> Path:
    """Export `prof`'s trace to `out_dir` through a temporary file: a crash leaves no half trace."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{worker}.{time.time_ns() // 1_000_000}.pt.trace.json.gz"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{final.name}.", suffix=".gz")  # .gz: torch gzips
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        fsync_path(Path(tmp))
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(out_dir)
    log.info("profiler trace written to %s", final)
    return final


class PhaseTrace:
    """One phase's torch.profiler session: `begin` once, `step` after each of its steps."""

    def __init__(self, out_dir: Path, worker: str, start: int, end: int, *, cuda: bool) -> None:
        self.out_dir, self.worker = out_dir, worker
        self.written: list[Path] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # start 0 leaves no step to warm up on, as asked
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
            )
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=lambda prof: self.written.append(write_trace(prof, self.out_dir, self.worker)),
            record_shapes=True,
            with_stack=True,
            profile_memory=True,
            with_flops=True,
        )
        self._running = False

    def begin(self) -> None:
        if not self._running:
            self._prof.start()
            self._running = True

    def step(self) -> None:
        self._prof.step()

    def close(self) -> None:
        """Stop the session; a trace window still open is written as far as it got."""
        if self._running:
            self._running = False
            self._prof.stop()

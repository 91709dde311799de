"""What one trainer rank profiles, from the profiling slice: the hooks its worker calls.

- `started()` once the rank joined its process groups: memory history starts (slime: at the actor's
  start, before the model is built).
- `initialized()` once its model is built: a train_overall trace starts.
- `phase(name)` around each train step (train_actor) and log-prob pass (train_log_probs): the
  phase's trace begins on its first step and counts one step after each.
- `rollout_trained(rollout_id)` after a rollout's last train step: train_overall counts one step,
  and the memory snapshot is dumped when that rollout is --memory-snapshot-num-steps - 1.
- `close()` when the rank shuts down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tether.train.profiling.config import ProfileConfig, ProfileTarget
from tether.train.profiling.memory import (
    CudaMemoryApi,
    CudaMemoryHistory,
    MemoryRecorder,
    MemrayCapture,
    snapshot_due,
    snapshot_path,
)
from tether.train.profiling.traces import PhaseTrace


class RankProfiler:
    def __init__(
        self,
        cfg: ProfileConfig,
        profile_dir: Path,
        *,
        rank: int,
        role: str = "actor",
        cuda: bool = False,
        memory_api: CudaMemoryApi | None = None,
    ) -> None:
        self.cfg = cfg
        prefix = "" if role == "actor" else f"{role}_"
        self.trace: PhaseTrace | None = None
        self.phase_name: ProfileTarget | None = cfg.traced
        if self.phase_name is not None:
            self.trace = PhaseTrace(
                profile_dir,
                f"{prefix}{self.phase_name}_rank_{rank}",
                cfg.profile_step_start,
                cfg.profile_step_end,
                cuda=cuda,
            )
        self.memory: MemoryRecorder | None = None
        if cfg.record_memory_history:
            snapshots = Path(cfg.memory_snapshot_dir) if cfg.memory_snapshot_dir is not None else profile_dir
            path = snapshot_path(snapshots, rank, f"{prefix}{cfg.memory_snapshot_path}")
            if cfg.memory_recorder == "memray":
                self.memory = MemrayCapture(path)
            else:
                self.memory = CudaMemoryHistory(path, memory_api)

    def started(self) -> None:
        if self.memory is not None:
            self.memory.start()

    def initialized(self) -> None:
        if self.trace is not None and self.phase_name == "train_overall":
            self.trace.begin()

    @contextlib.contextmanager
    def phase(self, name: ProfileTarget) -> Iterator[None]:
        if self.trace is None or name != self.phase_name:
            yield
            return
        self.trace.begin()
        yield
        self.trace.step()

    def rollout_trained(self, rollout_id: int) -> None:
        if self.trace is not None and self.phase_name == "train_overall":
            self.trace.step()
        if self.memory is not None and snapshot_due(rollout_id, self.cfg.memory_snapshot_num_steps):
            self.memory.stop()

    def close(self) -> None:
        try:
            if self.trace is not None:
                self.trace.close()
        finally:
            if self.memory is not None:
                self.memory.close()


def rank_profiler(cfg: ProfileConfig, profile_dir: str, *, rank: int, role: str) -> RankProfiler | None:
    """The rank's profiler when the slice asks for one (none otherwise: the hooks cost nothing)."""
    if not cfg.enabled:
        return None
    import torch

    return RankProfiler(cfg, Path(profile_dir), rank=rank, role=role, cuda=torch.cuda.is_available())

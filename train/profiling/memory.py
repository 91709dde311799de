"""Memory history of a trainer rank, as slime records it: started when the rank joins its process
groups, dumped on an out-of-memory error and once rollout --memory-snapshot-num-steps - 1 trained.

torch's recorder keeps CUDA allocator history (snapshots for pytorch.org/memory_viz); memray's
captures host memory. The CUDA calls sit behind `CudaMemoryApi` so the schedule is tested on CPU.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tether.runtime.errors import ConfigError
from tether.runtime.files.atomic_file import fsync_path

log = logging.getLogger(__name__)

HISTORY_ENTRIES = 1_000_000
"""Allocator events kept (slime's number); older ones fall off."""


def snapshot_due(rollout_id: int, num_steps: int | None) -> bool:
    """Whether the snapshot is dumped (and recording stops) once `rollout_id` has trained."""
    return num_steps is not None and rollout_id == num_steps - 1


def snapshot_path(directory: Path, rank: int, name: str, now: float | None = None) -> Path:
    """memory_snapshot_time<unix time>_rank<rank>_<name>, slime's snapshot name."""
    return directory / f"memory_snapshot_time{time.time() if now is None else now}_rank{rank}_{name}"


class CudaMemoryApi(Protocol):
    """The CUDA allocator calls the recorder makes."""

    def available(self) -> bool: ...
    def record(self) -> None: ...
    def stop_recording(self) -> None: ...
    def dump(self, path: str) -> None: ...
    def on_oom(self, observer: Callable[[], None]) -> None: ...


class TorchCudaMemory:
    """torch's CUDA allocator history (private API, as slime and Megatron use it)."""

    def available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def record(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="all")

    def stop_recording(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)

    def dump(self, path: str) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(path)

    def on_oom(self, observer: Callable[[], None]) -> None:
        import torch

        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            log.warning("this torch cannot observe CUDA out-of-memory errors; no snapshot is dumped on one")
            return
        attach(lambda device, alloc, device_alloc, device_free: observer())


class CudaMemoryHistory:
    """--memory-recorder torch."""

    def __init__(self, path: Path, api: CudaMemoryApi | None = None) -> None:
        self.path = path
        self.api: CudaMemoryApi = api or TorchCudaMemory()
        self.recording = False

    def start(self) -> None:
        if not self.api.available():
            raise ConfigError(
                "--record-memory-history",
                True,
                "records CUDA memory history: this trainer rank has no CUDA device",
            )
        self.api.record()
        self.recording = True
        self.api.on_oom(self._on_oom)
        log.info("recording CUDA memory history; snapshots go to %s", self.path)

    def _on_oom(self) -> None:
        log.error(
            "CUDA out of memory: memory snapshot to %s\n%s", self.path, "".join(traceback.format_stack())
        )
        self._dump()

    def _dump(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            self.api.dump(tmp)
            fsync_path(Path(tmp))
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_path(self.path.parent)

    def stop(self) -> None:
        """Dump the snapshot and stop recording."""
        if not self.recording:
            return
        self._dump()
        self.api.stop_recording()
        self.recording = False
        log.info("memory snapshot written to %s", self.path)

    def close(self) -> None:
        """End of the rank: nothing is dumped (slime dumps at the scheduled rollout or on OOM only)."""


class MemrayCapture:
    """--memory-recorder memray: memray's tracker of this process, written as it runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tracker: Any = None

    def start(self) -> None:
        try:
            import memray
        except ImportError as exc:
            raise ConfigError(
                "--memory-recorder", "memray", f"needs the memray package on the trainer ranks ({exc})"
            ) from exc
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tracker = memray.Tracker(file_name=str(self.path), native_traces=True)
        self._tracker.__enter__()
        log.info("memray capture started: %s", self.path)

    def stop(self) -> None:
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
            log.info("memray capture written to %s", self.path)

    def close(self) -> None:
        """End of the rank: a capture still running is closed so its file reads back."""
        self.stop()


MemoryRecorder = CudaMemoryHistory | MemrayCapture

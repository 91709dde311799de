"""slime's profiling flags on a real GPU (tether.train.profiling): --record-memory-history keeps
torch's CUDA allocator history and dumps a snapshot at rollout --memory-snapshot-num-steps - 1 and on
an out-of-memory error; --use-pytorch-profiler traces CUDA kernels. Skipped without CUDA."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest
import torch

from tether.train.profiling.config import ProfileConfig
from tether.train.profiling.rank_profiler import rank_profiler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _work() -> torch.Tensor:
    x = torch.randn(256, 256, device="cuda")
    y = x @ x
    torch.cuda.synchronize()
    return y


def test_memory_history_snapshot_at_the_scheduled_rollout(tmp_path: Path) -> None:
    cfg = ProfileConfig(record_memory_history=True, memory_snapshot_num_steps=2)
    prof = rank_profiler(cfg, str(tmp_path), rank=0, role="actor")
    assert prof is not None
    prof.started()
    prof.initialized()
    kept = []
    for rollout in range(3):
        kept.append(_work())
        prof.rollout_trained(rollout)
        if rollout == 0:
            assert not list(tmp_path.iterdir())
    prof.close()
    (snap,) = tmp_path.iterdir()
    assert snap.name.endswith("_rank0_snapshot.pickle")
    with snap.open("rb") as fh:
        data = pickle.load(fh)
    assert data["segments"], "the allocator's segments"
    traces = [e for device in data["device_traces"] for e in device]
    assert any(e["action"] == "alloc" and e.get("frames") for e in traces), "allocations with their stacks"


def test_cuda_kernels_are_traced(tmp_path: Path) -> None:
    cfg = ProfileConfig(
        use_pytorch_profiler=True, profile_target=["train_actor"], profile_step_start=1, profile_step_end=2
    )
    prof = rank_profiler(cfg, str(tmp_path), rank=0, role="actor")
    assert prof is not None
    for _ in range(3):
        with prof.phase("train_actor"):
            _work()
    prof.close()
    (trace,) = tmp_path.glob("train_actor_rank_0.*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "GPU kernels in the trace"


def test_an_out_of_memory_error_dumps_a_snapshot(tmp_path: Path) -> None:
    cfg = ProfileConfig(record_memory_history=True)  # no scheduled dump: out-of-memory only
    prof = rank_profiler(cfg, str(tmp_path), rank=0, role="actor")
    assert prof is not None
    prof.started()
    free, _total = torch.cuda.mem_get_info()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(free * 4, dtype=torch.uint8, device="cuda")
    (snap,) = tmp_path.iterdir()
    with snap.open("rb") as fh:
        assert "segments" in pickle.load(fh)
    torch.cuda.memory._record_memory_history(enabled=None)

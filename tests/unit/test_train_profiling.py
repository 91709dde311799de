"""slime's profiling and memory flags (tether.train.profiling): what each refuses, which steps a
torch.profiler trace covers on a CPU trainer rank, and when memory snapshots are dumped (the CUDA
calls behind a fake; tests/gpu/test_profiling_cuda.py makes them on a GPU)."""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from support.train_checks.launcher import make_batch

from tether.config import resolve
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.profiling.config import ProfileConfig
from tether.train.profiling.memory import snapshot_due
from tether.train.profiling.rank_profiler import RankProfiler
from tether.train.rank import step
from tether.train.rank.protocol import InitRequest, LogProbsRequest, TrainRequest
from tether.train.rank.worker import TrainerWorker

# --- the flags ---------------------------------------------------------------------------------


def test_the_flags_parse_with_slimes_and_megatrons_names() -> None:
    cfg = resolve(
        "--use-pytorch-profiler --profile-target train_log_probs --profile-step-start 2 "
        "--profile-step-end 4".split()
    )
    assert cfg.profile.traced == "train_log_probs"
    assert (cfg.profile.profile_step_start, cfg.profile.profile_step_end) == (2, 4)
    mem = resolve(
        "--record-memory-history --memory-snapshot-num-steps 3 --memory-snapshot-dir /tmp/snap "
        "--memory-snapshot-path run.pickle".split()
    ).profile
    assert (mem.memory_recorder, mem.memory_snapshot_num_steps, mem.memory_snapshot_dir) == (
        "torch",
        3,
        "/tmp/snap",
    )
    assert not resolve([]).profile.enabled


@pytest.mark.parametrize(
    ("argv", "key", "reason"),
    [
        # torch.profiler runs one session per process
        (
            "--use-pytorch-profiler --profile-target train_overall train_actor",
            "--profile-target",
            "traces one phase",
        ),
        ("--use-pytorch-profiler --profile-step-start 5 --profile-step-end 5", "--profile-step-end", "above"),
        # a value nothing would use
        ("--profile-step-start 1", "--profile-step-start", "needs --use-pytorch-profiler"),
        ("--profile-target train_actor", "--profile-target", "give one of them"),
        ("--memory-snapshot-num-steps 2", "--memory-snapshot-num-steps", "needs --record-memory-history"),
        ("--memory-snapshot-dir /x", "--memory-snapshot-dir", "needs --record-memory-history"),
        ("--memory-recorder memray", "--memory-recorder", "needs --record-memory-history"),
        ("--record-memory-history --profile-target train_actor", "--profile-target", "needs train_overall"),
        (
            "--record-memory-history --memory-recorder memray",
            "--memory-recorder",
            "--memory-snapshot-num-steps",
        ),
        ("--record-memory-history --memory-snapshot-num-steps 0", "--memory-snapshot-num-steps", ">= 1"),
        ("--use-pytorch-profiler --debug-rollout-only", "--use-pytorch-profiler", "starts none"),
    ],
)
def test_a_flag_that_would_record_nothing_is_refused(argv: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as err:
        resolve(argv.split())
    assert err.value.key == key


def test_cuda_memory_history_is_refused_on_a_cpu_plan_and_memray_is_not() -> None:
    with pytest.raises(ConfigError, match=r"CUDA memory history.*--cpu-devices") as err:
        resolve(["--cpu-devices", "2", "--record-memory-history"])
    assert (err.value.key, err.value.value) == ("--record-memory-history", True)
    cfg = resolve(
        "--cpu-devices 2 --record-memory-history --memory-recorder memray --memory-snapshot-num-steps 1".split()
    )
    assert cfg.profile.memory_recorder == "memray"
    assert resolve(["--cpu-devices", "2", "--use-pytorch-profiler"]).profile.traced == "train_overall"


def test_release_train_stays_refused_with_what_to_use_instead() -> None:
    with pytest.raises(ConfigError, match=r"one torchrun job kept for the whole run.*--offload-train") as err:
        resolve(["--release-train"])
    assert err.value.key == "--release-train"


# --- memory snapshots: when, where, how --------------------------------------------------------


class FakeCuda:
    """The CUDA allocator calls, recorded; `dump` writes what a snapshot would hold."""

    def __init__(self, available: bool = True) -> None:
        self.calls: list[str] = []
        self.oom: Any = None
        self._available = available

    def available(self) -> bool:
        return self._available

    def record(self) -> None:
        self.calls.append("record")

    def stop_recording(self) -> None:
        self.calls.append("stop")

    def dump(self, path: str) -> None:
        self.calls.append("dump")
        Path(path).write_bytes(b"snapshot")

    def on_oom(self, observer: Any) -> None:
        self.oom = observer


def test_snapshot_is_due_after_rollout_num_steps_minus_one_only() -> None:
    assert [r for r in range(6) if snapshot_due(r, 3)] == [2]
    assert not any(snapshot_due(r, None) for r in range(6))


def test_memory_history_starts_with_the_rank_and_dumps_once_at_the_scheduled_rollout(tmp_path: Path) -> None:
    cfg = ProfileConfig(record_memory_history=True, memory_snapshot_num_steps=2)
    cuda = FakeCuda()
    prof = RankProfiler(cfg, tmp_path, rank=3, memory_api=cuda)
    prof.started()
    assert cuda.calls == ["record"] and cuda.oom is not None
    prof.initialized()
    prof.rollout_trained(0)
    assert cuda.calls == ["record"]
    prof.rollout_trained(1)  # rollout N - 1: dump, then recording stops
    assert cuda.calls == ["record", "dump", "stop"]
    (snap,) = tmp_path.iterdir()  # no temporary file left beside it
    assert snap.name.startswith("memory_snapshot_time") and snap.name.endswith("_rank3_snapshot.pickle")
    assert snap.read_bytes() == b"snapshot"
    prof.rollout_trained(2)
    prof.close()  # nothing more at the end (slime dumps at the scheduled rollout or on OOM only)
    assert cuda.calls == ["record", "dump", "stop"]


def test_an_out_of_memory_error_dumps_a_snapshot_and_a_critics_name_says_so(tmp_path: Path) -> None:
    cfg = ProfileConfig(record_memory_history=True, memory_snapshot_dir=str(tmp_path / "snaps"))
    cuda = FakeCuda()
    prof = RankProfiler(cfg, tmp_path / "unused", rank=0, role="critic", memory_api=cuda)
    prof.started()
    cuda.oom()
    (snap,) = (tmp_path / "snaps").iterdir()
    assert snap.name.endswith("_rank0_critic_snapshot.pickle")
    for rollout in range(5):  # without --memory-snapshot-num-steps: out-of-memory only
        prof.rollout_trained(rollout)
    assert cuda.calls == ["record", "dump"]


def test_a_rank_without_cuda_refuses_memory_history(tmp_path: Path) -> None:
    prof = RankProfiler(
        ProfileConfig(record_memory_history=True), tmp_path, rank=0, memory_api=FakeCuda(available=False)
    )
    with pytest.raises(ConfigError, match="no CUDA device") as err:
        prof.started()
    assert err.value.key == "--record-memory-history"


def test_memray_captures_from_the_start_to_the_scheduled_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[Any] = []

    class Tracker:
        def __init__(self, file_name: str, native_traces: bool) -> None:
            events.append(("new", Path(file_name).name, native_traces))

        def __enter__(self) -> None:
            events.append("enter")

        def __exit__(self, *exc: object) -> None:
            events.append("exit")

    monkeypatch.setitem(sys.modules, "memray", types.SimpleNamespace(Tracker=Tracker))
    cfg = ProfileConfig(record_memory_history=True, memory_recorder="memray", memory_snapshot_num_steps=1)
    prof = RankProfiler(cfg, tmp_path, rank=1)
    prof.started()
    prof.rollout_trained(0)
    prof.close()
    (new, enter, exit_) = events
    assert new[1].endswith("_rank1_snapshot.pickle") and new[2] is True
    assert (enter, exit_) == ("enter", "exit")


def test_memray_missing_on_a_rank_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memray", None)  # import memray raises ImportError
    cfg = ProfileConfig(record_memory_history=True, memory_recorder="memray", memory_snapshot_num_steps=1)
    with pytest.raises(ConfigError, match="memray package") as err:
        RankProfiler(cfg, tmp_path, rank=0).started()
    assert err.value.key == "--memory-recorder"


# --- torch.profiler traces on a CPU trainer rank -------------------------------------------------

ACTOR = SimpleNamespace(
    chunks=[], config=None, arch=SimpleNamespace(vocab_size=320), optimizer=None, scheduler=None
)


def _matmul() -> None:
    x = torch.ones(8, 8)
    (x @ x).sum()


def _steps_in(trace: Path) -> set[int]:
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::mm" in n for n in names), "the work ran inside the trace"
    return {int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#")}


def _drive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg: ProfileConfig, rollouts: int, role: str = "actor"
) -> list[Path]:
    """An in-process rank (the model stubbed by a matmul) as the head drives it: per rollout one
    log-prob pass and two train steps; then shutdown. Its profiler comes from its InitRequest."""

    def train_step(*args: Any, **kwargs: Any) -> dict[str, float]:
        _matmul()
        return {"loss": 0.0}

    def compute_log_probs(*args: Any, **kwargs: Any) -> tuple[np.ndarray, None]:
        _matmul()
        return np.zeros(1, dtype=np.float32), None

    monkeypatch.setattr(step, "train_step", train_step)
    monkeypatch.setattr(step, "compute_log_probs", compute_log_probs)
    batch, plan = make_batch(2, seed=0), [[0, 1]]

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            worker = TrainerWorker(pool)
            worker._actor, worker._algorithm = ACTOR, AlgorithmConfig()
            init = InitRequest(
                hf_checkpoint="unused",
                algorithm=AlgorithmConfig(),
                megatron=MegatronConfig(),
                profile=cfg,
                profile_dir=str(tmp_path),
            )
            await worker._run(lambda: worker._start_profiler(init))  # as init does, then builds models
            await worker._run(worker._profiler.initialized)
            for rollout in range(rollouts):
                await worker.compute_log_probs(LogProbsRequest(shard=batch, plan=plan))
                for i in range(2):
                    request = TrainRequest(
                        rollout_id=rollout,
                        shard=batch,
                        plan=plan,
                        first_of_rollout=i == 0,
                        last_of_rollout=i == 1,
                    )
                    await worker.train(request)
            await worker.shutdown()

    asyncio.run(scenario())
    return sorted(tmp_path.glob("*.pt.trace.json.gz"))


@pytest.mark.parametrize(
    ("target", "steps"),
    [
        ("train_overall", 4),
        ("train_actor", 8),
        ("train_log_probs", 4),
    ],  # steps each target counts in 4 rollouts
)
def test_a_phase_is_traced_over_its_scheduled_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, steps: int
) -> None:
    cfg = ProfileConfig(
        use_pytorch_profiler=True, profile_target=[target], profile_step_start=1, profile_step_end=3
    )
    (trace,) = _drive(tmp_path, monkeypatch, cfg, rollouts=4)
    assert trace.name.startswith(f"{target}_rank_0.")
    assert _steps_in(trace) == {1, 2}  # start..end-1, after one warm-up step
    assert not list(tmp_path.glob(".*"))  # written through a temporary file, none left


def test_a_window_open_at_shutdown_is_written_as_far_as_it_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ProfileConfig(
        use_pytorch_profiler=True, profile_target=["train_actor"], profile_step_start=0, profile_step_end=10
    )
    (trace,) = _drive(tmp_path, monkeypatch, cfg, rollouts=1, role="actor")
    assert _steps_in(trace) == {0, 1, 2}  # the two train steps, and the (empty) step they opened


def test_without_the_flags_a_rank_has_no_profiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ThreadPoolExecutor(1) as pool:
        worker = TrainerWorker(pool)
        init = InitRequest(hf_checkpoint="unused", algorithm=AlgorithmConfig(), megatron=MegatronConfig())
        worker._start_profiler(init)
        assert worker._profiler is None

"""Every step is in the model exactly once, whatever stops the head and wherever in a step.

The real loops, `Steps`, signal handling (`run_loop`) and `resume` drive fake components whose
"weights" are the list of steps applied to them. A stop signal (SIGTERM), a checkpoint-and-go
signal (SIGUSR1) or a crash of the head (the loop dies, no checkpoint) arrives at each phase of
a step — rollout, train, sync, after-step — in each of the three loops; the run then resumes
with --auto-resume and runs to the end. Checked: every checkpoint's label, data position,
weight version and weights belong to one step boundary; the final weights hold each step once;
samples.jsonl says exactly that (steps after the resumed checkpoint recorded as discarded);
ledger versions never go down.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tether.config import Config, resolve
from tether.records.metrics import MetricsSink
from tether.records.progress import RunProgress
from tether.records.run_dir import RunDir, model_steps, read_jsonl
from tether.rollout.sample import Sample
from tether.run.job import resume, run_loop
from tether.run.loops import LoopRange
from tether.run.steps import Steps
from tether.runtime.process.sdnotify import Notifier
from tether.runtime.process.signals import StopRequested, handle_signals
from tether.sync.ledger import LedgerEntry
from tether.train.rank.protocol import LoadedState

STEPS = 6
PHASES = ("rollout", "train", "sync", "after_step")


class Crash(Exception):
    """The head dies here (as under SIGKILL): nothing after this point happens."""


class Fault:
    """What happens when the run reaches `phase` of step `step`."""

    def __init__(self, phase: str, step: int, kind: str, run_dir: RunDir) -> None:
        self.phase, self.step, self.kind, self.run_dir = phase, step, kind, run_dir
        self.fired = False
        self.steps: Steps

    async def at(self, phase: str, step: int) -> None:
        if self.fired or (phase, step) != (self.phase, self.step):
            return
        self.fired = True
        if self.kind == "crash":
            raise Crash(f"{phase} of step {step}")
        seen = len(read_jsonl(self.run_dir.events_path))
        os.kill(os.getpid(), signal.SIGTERM if self.kind == "term" else signal.SIGUSR1)
        # Stay in this phase until the head has taken the signal's checkpoint in hand: saved
        # it, deferred it to the end of the step under way, or waits for the trainer phase
        # this fault sits in to release the trainer.
        lock = self.steps.trainer_lock
        for _ in range(2000):  # polls a condition other tasks make true; 10 s at most
            if (
                (lock.locked() and lock._waiters)
                or any(  # type: ignore[attr-defined]
                    e["event"] in ("checkpoint", "checkpoint_deferred")
                    for e in read_jsonl(self.run_dir.events_path)[seen:]
                )
            ):
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"the head never took the signal at {phase} of step {step}")


class Disk:
    """What outlives the head: checkpoints (the weights as applied steps) and their labels."""

    def __init__(self) -> None:
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self.latest: int | None = None


class FakeTrainer:
    critic = None

    def __init__(self, disk: Disk, fault: Fault | None) -> None:
        self.disk, self.fault = disk, fault
        self.applied: list[int] = []  # the weights: every step whose update is in them

    def lost_node(self) -> None:
        return None  # its ranks' nodes stay up (a lost one: test_e2e_two_nodes_netns.py)

    async def _at(self, phase: str, step: int) -> None:
        if self.fault is not None:
            await self.fault.at(phase, step)

    async def train(self, rollout_id: int, groups: Any, *, weight_version: int) -> dict[str, float]:
        await self._at("train", rollout_id)
        await asyncio.sleep(0)
        self.applied.append(rollout_id)
        return {"train/loss": 0.0}

    async def update_weights(
        self,
        version: int,
        urls: list[str],
        *,
        engines_restarted: bool = False,
        engine_sizes: list[int] | None = None,
    ) -> LedgerEntry:
        await self._at("sync", self.applied[-1] if self.applied else -1)
        return LedgerEntry(
            version=version,
            transport="fake",
            bytes_moved=0,
            pause_seconds=0.0,
            total_seconds=0.0,
            engine_versions={"engine0": version},
            started_at=0.0,
            finished_at=0.0,
        )

    async def save(
        self, rollout_id: int, weight_version: int, position: dict[str, Any], *, finalize: bool = False
    ) -> Path:
        self.disk.checkpoints[rollout_id] = {
            "applied": list(self.applied),
            "weight_version": weight_version,
            "data_position": dict(position),
        }
        self.disk.latest = rollout_id
        return Path(f"iter_{rollout_id:07d}")

    async def load(
        self, load_dir: str, *, finetune: bool = False, hf: bool = False, **_step: Any
    ) -> LoadedState | None:
        if self.disk.latest is None:
            return None
        saved = self.disk.checkpoints[self.disk.latest]
        self.applied = list(saved["applied"])
        return LoadedState(
            step=self.disk.latest,
            rollout_id=self.disk.latest,
            weight_version=saved["weight_version"],
            data_position=saved["data_position"],
            path=f"iter_{self.disk.latest:07d}",
        )


class FakeEngines:
    def __init__(self) -> None:
        self.urls = ["http://127.0.0.1:1"]
        self.metrics: dict[str, float] = {}
        self.served_version = 0

    def sizes_of(self, urls: list[str]) -> list[int]:
        return [1] * len(urls)

    async def watch(self) -> None:
        await asyncio.Event().wait()


class FakeRollouts:
    """One group of two samples per rollout, drawn from a data source whose position is the
    number of groups drawn; the fully-async worker draws one rollout ahead."""

    speculative_early = None  # no first rollout started before the loop

    router = None
    data = None  # not tether's DataSource: no slime data-state file is written

    def __init__(self, fault: Fault | None, loop: str) -> None:
        self.fault, self.loop = fault, loop
        self.offset = 0
        self.metrics: dict[str, float] = {}
        self.weight_version = 0
        self._positions: dict[int, dict[str, Any]] = {}
        self._ahead: list[list[Sample]] | None = None

    def _draw(self, rollout_id: int) -> list[list[Sample]]:
        group = self.offset
        self.offset += 1
        return [
            [
                Sample(index=2 * group + i, group_index=group, weight_versions=[str(self.weight_version)])
                for i in range(2)
            ]
        ]

    async def generate(self, rollout_id: int) -> list[list[Sample]]:
        if self.fault is not None:
            await self.fault.at("rollout", rollout_id)
        await asyncio.sleep(0)
        groups = self._draw(rollout_id)
        self._positions[rollout_id] = self.position()
        return groups

    async def get_batch(self, rollout_id: int) -> list[list[Sample]]:
        if self.fault is not None:
            await self.fault.at("rollout", rollout_id)
        groups = self._ahead if self._ahead is not None else self._draw(rollout_id)
        self._ahead = self._draw(rollout_id + 1)  # drawn ahead, not consumed
        return groups

    async def pause(self) -> None: ...

    async def resume(self, weight_version: int | None) -> None:
        if weight_version is not None:
            self.weight_version = weight_version

    def position(self) -> dict[str, Any]:
        # Like the real worker: groups drawn ahead but not consumed go back into the position.
        return {"offset": self.offset - (1 if self._ahead is not None else 0)}

    def position_after(self, rollout_id: int) -> dict[str, Any]:
        return self._positions.pop(rollout_id, None) or self.position()

    def load_position(self, position: dict[str, Any]) -> None:
        self.offset = position["offset"]

    async def save_source(self, rollout_id: int) -> None: ...  # no --data-source-path class here

    def eval_due(self, rollout_id: int) -> bool:
        return True  # the after-step phase's await point

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        if self.fault is not None:
            await self.fault.at("after_step", rollout_id)
        return {}


class FakeSupervisor:
    async def watch(self) -> None:
        await asyncio.Event().wait()


def config(loop: str, run: Path) -> Config:
    return resolve(
        [
            "--num-rollout",
            str(STEPS),
            "--loop",
            loop,
            "--save",
            str(run / "ckpt"),
            "--save-interval",
            "2",
            "--auto-resume",
            "--run-dir",
            str(run),
        ]
    )


async def one_attempt(cfg: Config, run_dir: RunDir, disk: Disk, fault: Fault | None) -> FakeTrainer:
    trainer = FakeTrainer(disk, fault)
    rollouts = FakeRollouts(fault, cfg.run.loop)
    sink = MetricsSink(run_dir)
    steps = Steps(
        cfg,
        run_dir,
        trainer,  # type: ignore[arg-type]
        FakeEngines(),  # type: ignore[arg-type]
        rollouts,  # type: ignore[arg-type]
        sink,
        RunProgress(STEPS, 0, "plain"),
        Notifier(None),
    )
    if fault is not None:
        fault.steps = steps
    start = await resume(cfg, steps)
    try:
        async with handle_signals(steps.checkpoint) as stop:
            await run_loop(cfg, LoopRange(start, STEPS), FakeSupervisor(), steps, stop)  # type: ignore[arg-type]
    except* (StopRequested, Crash):
        pass
    finally:
        sink.close()
    return trainer


@pytest.mark.parametrize("kind", ["term", "usr1", "crash"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("loop", ["sync", "async", "fully-async"])
def test_each_step_is_in_the_model_once(loop: str, phase: str, kind: str, tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    cfg = config(loop, tmp_path)
    disk = Disk()
    fault = Fault(phase, 3, kind, run_dir)  # mid-run, between the interval checkpoints 1 and 3
    first = asyncio.run(one_attempt(cfg, run_dir, disk, fault))
    assert fault.fired
    events = read_jsonl(run_dir.events_path)
    if kind == "term":  # stopped at a step boundary, right after the signal's checkpoint
        assert disk.latest == first.applied[-1]
    first_steps = [r["step"] for r in read_jsonl(run_dir.samples_path)]
    resumed_from = disk.latest
    final = asyncio.run(one_attempt(cfg, run_dir, disk, None)) if kind != "usr1" else first
    if kind == "usr1":  # checkpoint and carry on: the run went to the end by itself
        assert any(e["event"] == "checkpoint" and e["reason"] == "signal" for e in events)

    # The final weights hold every step exactly once.
    assert final.applied == list(range(STEPS))
    # Every checkpoint ever written belongs to one step boundary.
    for label, saved in disk.checkpoints.items():
        assert saved["applied"] == list(range(label + 1)), f"checkpoint {label} holds {saved['applied']}"
        assert saved["data_position"] == {"offset": label + 1}, f"checkpoint {label}"
    # samples.jsonl tells which steps are in the model, and nothing was trained twice in it.
    records = read_jsonl(run_dir.samples_path)
    told = model_steps(records)
    assert told.steps == list(range(STEPS)) and told.duplicates == []
    live = {r["step"]: r for r in records if "step" in r}  # the last record of each step
    indices = [s[0] for r in live.values() for s in r["samples"]]
    assert sorted(indices) == list(range(2 * STEPS)), "a sample index was trained twice or lost"
    # Steps trained after the checkpoint the run resumed from are recorded as discarded.
    after = [step for step in first_steps if resumed_from is None or step > resumed_from]
    assert told.discarded == (after if kind != "usr1" else [])
    # Ledger versions never go down, across the resume too.
    versions = [e["version"] for e in read_jsonl(run_dir.ledger_path)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)

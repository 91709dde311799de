"""The loops' orderings: what runs before what, and which weights each rollout was made with."""

from __future__ import annotations

import asyncio

import pytest

from tether.run.loops import Groups, LoopRange, async_loop, fully_async_loop, sync_loop


class Recorder:
    """Fake components sharing one event log; rollouts record the weight version they used."""

    def __init__(self, interval: int = 1, stop_after: int | None = None) -> None:
        self.log: list[str] = []
        self.version = 0
        self.interval = interval
        self.stop_after = stop_after
        self.generation_started: dict[int, asyncio.Event] = {}
        self.used_version: dict[int, int] = {}
        self.paused = False

    async def generate(self, rollout_id: int) -> Groups:
        self.log.append(f"gen{rollout_id}-start")
        self.used_version[rollout_id] = self.version
        await asyncio.sleep(0)  # yield so that overlapping work can interleave
        self.log.append(f"gen{rollout_id}-end")
        return []

    async def get_batch(self, rollout_id: int) -> Groups:
        assert not self.paused
        return await self.generate(rollout_id)

    async def pause(self) -> None:
        self.paused = True
        self.log.append("pause")

    async def resume(self, weight_version: int | None) -> None:
        self.paused = False
        self.log.append(f"resume{weight_version}")

    async def train(self, rollout_id: int, groups: Groups) -> None:
        self.log.append(f"train{rollout_id}-start")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.log.append(f"train{rollout_id}-end")

    async def sync_weights(self, rollout_id: int) -> int:
        self.version += 1
        self.log.append(f"sync{self.version}")
        return self.version

    async def after_step(self, rollout_id: int) -> None:
        self.log.append(f"step{rollout_id}")

    def sync_due(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.interval == 0

    def should_stop(self) -> bool:
        return self.stop_after is not None and f"step{self.stop_after}" in self.log


def test_sync_loop_alternates() -> None:
    r = Recorder()
    asyncio.run(sync_loop(LoopRange(0, 3), r, r))
    assert [e for e in r.log if not e.endswith("-end")] == [
        "gen0-start",
        "train0-start",
        "sync1",
        "step0",
        "gen1-start",
        "train1-start",
        "sync2",
        "step1",
        "gen2-start",
        "train2-start",
        "sync3",
        "step2",
    ]
    assert r.used_version == {0: 0, 1: 1, 2: 2}


def test_async_loop_overlaps_and_drains_before_sync() -> None:
    r = Recorder()
    asyncio.run(async_loop(LoopRange(0, 4), r, r))
    log = r.log
    # rollout N+1 starts before training N ends ...
    assert log.index("gen1-start") < log.index("train0-end")
    # ... and is drained (finished) before the weights change.
    assert log.index("gen1-end") < log.index("sync1")
    # each rollout is made by the weights of one sync earlier: lag of exactly one version
    assert r.used_version == {0: 0, 1: 0, 2: 1, 3: 2}
    assert log.count("gen1-start") == 1 and log[-1] == "step3"


def test_async_loop_with_sync_interval() -> None:
    r = Recorder(interval=2)
    asyncio.run(async_loop(LoopRange(0, 4), r, r))
    assert [e for e in r.log if e.startswith("sync")] == ["sync1", "sync2"]
    assert r.used_version[3] == 1


def test_fully_async_pauses_around_sync_and_stops_on_request() -> None:
    r = Recorder(stop_after=6)
    asyncio.run(fully_async_loop(LoopRange(5, 9), r, r))
    assert [e for e in r.log if not e.endswith("-end") and not e.endswith("-start")] == [
        "pause",
        "sync1",
        "resume1",
        "step5",
        "pause",
        "sync2",
        "resume2",
        "step6",
    ]
    assert "gen7-start" not in r.log


def test_fully_async_resumes_after_a_failed_sync() -> None:
    class Failing(Recorder):
        async def sync_weights(self, rollout_id: int) -> int:
            raise RuntimeError("engine gone")

    r = Failing()
    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(fully_async_loop(LoopRange(0, 2), r, r))
    assert r.log[-2:] == ["pause", "resumeNone"] and not r.paused

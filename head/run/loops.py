"""The three training loops. Each reads in one screen; the pieces they drive live elsewhere.

sync         rollout N → train N → sync → rollout N+1
async        rollout N+1 generates while N trains; the in-flight rollout is drained
             before each weight sync, so every sample is at most one version behind
fully-async  a warm worker generates across steps; each step takes the next target batch
             when it is ready; a weight sync pauses the worker, syncs and resumes it
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from tether.rollout.sample import Sample

Groups = list[list[Sample]]


class Rollouts(Protocol):
    """Where a loop gets its rollouts from (the rollout manager)."""

    async def generate(self, rollout_id: int) -> Groups: ...


class WarmRollouts(Protocol):
    """The fully-async worker, seen from the loop."""

    async def get_batch(self, rollout_id: int) -> Groups: ...
    async def pause(self) -> None: ...
    async def resume(self, weight_version: int | None) -> None: ...


class StepHooks(Protocol):
    """What happens around each step: train, sync, checkpoint, evaluate, record."""

    async def train(self, rollout_id: int, groups: Groups) -> None: ...
    async def sync_weights(self, rollout_id: int) -> int: ...
    async def after_step(self, rollout_id: int) -> None: ...
    def sync_due(self, rollout_id: int) -> bool: ...
    def should_stop(self) -> bool: ...


@dataclass
class LoopRange:
    start: int
    stop: int
    ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = list(range(self.start, self.stop))


async def sync_loop(steps: LoopRange, rollouts: Rollouts, hooks: StepHooks) -> None:
    for rollout_id in steps.ids:
        groups = await rollouts.generate(rollout_id)
        await hooks.train(rollout_id, groups)
        if hooks.sync_due(rollout_id):
            await hooks.sync_weights(rollout_id)
        await hooks.after_step(rollout_id)
        if hooks.should_stop():
            return


async def async_loop(steps: LoopRange, rollouts: Rollouts, hooks: StepHooks) -> None:
    if not steps.ids:
        return
    async with asyncio.TaskGroup() as tg:
        pending: asyncio.Task[Groups] | None = tg.create_task(rollouts.generate(steps.ids[0]))
        for position, rollout_id in enumerate(steps.ids):
            assert pending is not None
            groups = await pending
            following = steps.ids[position + 1] if position + 1 < len(steps.ids) else None
            pending = tg.create_task(rollouts.generate(following)) if following is not None else None
            await hooks.train(rollout_id, groups)
            if hooks.sync_due(rollout_id):
                # Drain: the rollout in flight finishes on the old weights before they change.
                drained = await pending if pending is not None else None
                await hooks.sync_weights(rollout_id)
                pending = tg.create_task(_ready(drained)) if drained is not None else None
            await hooks.after_step(rollout_id)
            if hooks.should_stop():
                if pending is not None:
                    pending.cancel()
                return


async def _ready(groups: Groups) -> Groups:
    return groups


async def fully_async_loop(steps: LoopRange, worker: WarmRollouts, hooks: StepHooks) -> None:
    for rollout_id in steps.ids:
        groups = await worker.get_batch(rollout_id)
        await hooks.train(rollout_id, groups)
        if hooks.sync_due(rollout_id):
            await worker.pause()
            version: int | None = None
            try:
                version = await hooks.sync_weights(rollout_id)
            finally:
                # Resume even when the sync failed: the engines still serve the old version.
                await worker.resume(version)
        await hooks.after_step(rollout_id)
        if hooks.should_stop():
            return

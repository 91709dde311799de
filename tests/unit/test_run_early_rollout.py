"""Which runs start their first rollout while the trainer ranks start (`starts_rollout_early`):
only those whose engines already serve the weights the first step trains from, with nothing
else to reach the engines first. A whole run that does: tests/integration/test_e2e_run.py. And how the rollout manager hands
the early rollout to the loop, once, or cancels it when the run ends before its first step."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.rollout import make_config

from tether.config import resolve
from tether.run.job import starts_rollout_early
from tether.run.rollout_manager import RolloutManager

FRESH = ["--hf-checkpoint", "/models/tiny", "--prompt-data", "/data/p.jsonl", "--num-rollout", "3"]


def test_a_fresh_run_from_the_hf_checkpoint_starts_its_first_rollout_early() -> None:
    assert starts_rollout_early(resolve(FRESH))
    assert starts_rollout_early(resolve([*FRESH, "--loop", "fully-async"]))


@pytest.mark.parametrize(
    "extra",
    [
        # The trainer starts from other weights than the engines load (or may resume).
        ["--load", "{tmp}/ckpt"],
        ["--ref-load", "{tmp}/ref"],
        ["--auto-resume", "--save", "{tmp}/save"],
        # Something must reach the engines before the first rollout.
        ["--check-weight-update-equal"],
        ["--use-fault-tolerance"],
        # No trainer to overlap, or no engines; or the trainers start after the engines anyway.
        ["--debug-rollout-only"],
        ["--debug-train-only"],
        ["--colocate"],
    ],
    ids=lambda extra: extra[0],
)
def test_runs_whose_first_rollout_must_wait_do(tmp_path: Path, extra: list[str]) -> None:
    cfg = resolve([*FRESH, *(e.format(tmp=tmp_path) for e in extra)])
    assert not starts_rollout_early(cfg)


class _Counting:
    """Stands in for the rollout itself: counts the rollouts made, each ends when released."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.release = asyncio.Event()
        self.cancelled = False

    async def __call__(self, rollout_id: int) -> list[list[Any]]:
        self.made.append(rollout_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return [[f"rollout {rollout_id}"]]


def _manager(rollout: _Counting) -> RolloutManager:
    manager = RolloutManager(make_config(), router=None)
    manager._generate = rollout  # type: ignore[method-assign]
    return manager


def test_the_loop_takes_the_early_rollout_instead_of_making_it_again() -> None:
    async def scenario() -> None:
        rollout = _Counting()
        manager = _manager(rollout)
        await manager.start_early(0)
        await asyncio.sleep(0)  # it runs before anyone asks for it
        assert rollout.made == [0]
        rollout.release.set()
        assert await manager.generate(0) == [["rollout 0"]]
        assert await manager.generate(1) == [["rollout 1"]]
        assert rollout.made == [0, 1]  # rollout 0 once

    asyncio.run(scenario())


def test_an_exit_before_the_first_step_cancels_the_early_rollout() -> None:
    async def scenario() -> None:
        rollout = _Counting()
        manager = _manager(rollout)
        await manager.start_early(0)
        await asyncio.sleep(0)
        await manager.__aexit__(None, None, None)  # the run ends: the trainers failed to start
        assert rollout.made == [0] and rollout.cancelled

    asyncio.run(scenario())


def test_a_loop_that_begins_elsewhere_gets_an_error_not_the_early_rollout() -> None:
    async def scenario() -> None:
        rollout = _Counting()
        manager = _manager(rollout)
        await manager.start_early(0)
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="rollout 0 was started early, but the loop began at 3"):
            await manager.generate(3)
        await asyncio.sleep(0)
        assert rollout.cancelled

    asyncio.run(scenario())

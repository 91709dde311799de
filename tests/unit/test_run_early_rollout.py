"""Which runs start their first rollout while the trainer ranks start (`starts_rollout_early`):
only those whose engines already serve the weights the first step trains from, with nothing
else to reach the engines first. A whole run that does: tests/integration/test_e2e_run.py. Which
start it speculatively, on weights the actor may not start from (`speculates_rollout_early`;
kept and discarded in whole runs: tests/integration/test_e2e_start_checkpoint.py). And how the
rollout manager hands the early rollout to the loop, once, or cancels it when the run ends
before its first step or the caller discards it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.rollout import make_config

from tether.config import resolve
from tether.run.job import speculates_rollout_early, starts_rollout_early
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


def _hf_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "extra",
    [
        ["--ref-load", "{tmp}/ref"],
        ["--ref-load", "{tmp}/ref", "--load", "{tmp}/save", "--save", "{tmp}/save"],  # slime's first launch
        ["--load", "{hf}"],
        ["--load", "{tmp}/nothing_here"],
        ["--auto-resume", "--save", "{tmp}/save", "--loop", "async"],
        [
            "--ref-load",
            "{tmp}/ref",
            "--rollout-function-path",
            "tether.rollout.hooks.default_rollout.generate_rollout",
        ],
    ],
    ids=lambda extra: "-".join(e.strip("-{}/") for e in extra[::2]),
)
def test_runs_that_may_start_from_the_engines_weights_speculate(tmp_path: Path, extra: list[str]) -> None:
    hf = _hf_dir(tmp_path / "hf")
    cfg = resolve([*FRESH, *(e.format(tmp=tmp_path, hf=hf) for e in extra)])
    assert speculates_rollout_early(cfg) and not starts_rollout_early(cfg)


@pytest.mark.parametrize(
    "extra",
    [
        [],  # fresh: certain, not speculative
        ["--load", "{ckpt}"],  # the head sees a checkpoint to resume
        ["--auto-resume", "--save", "{ckpt}"],
        # A discard could not put everything back.
        ["--ref-load", "{tmp}/ref", "--loop", "fully-async"],
        ["--ref-load", "{tmp}/ref", "--rollout-function-path", "my_rollouts.generate"],
        ["--ref-load", "{tmp}/ref", "--data-source-path", "my_sources.Source"],
        # As for any early rollout.
        ["--ref-load", "{tmp}/ref", "--check-weight-update-equal"],
        ["--ref-load", "{tmp}/ref", "--use-fault-tolerance"],
        ["--ref-load", "{tmp}/ref", "--colocate"],
    ],
    ids=lambda extra: "-".join(e.strip("-{}/") for e in extra[::2]) or "fresh",
)
def test_runs_that_must_not_speculate_do_not(tmp_path: Path, extra: list[str]) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    cfg = resolve([*FRESH, *(e.format(tmp=tmp_path, ckpt=ckpt) for e in extra)])
    assert not speculates_rollout_early(cfg)


class _Counting:
    """Stands in for the rollout itself: counts the rollouts made, each ends when released."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.release = asyncio.Event()
        self.cancelled = False

    async def __call__(self, rollout_id: int) -> tuple[list[list[Any]], float]:
        self.made.append(rollout_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return [[f"rollout {rollout_id}"]], 0.5


def _manager(rollout: _Counting) -> RolloutManager:
    manager = RolloutManager(make_config(), router=None)
    manager._produce = rollout  # type: ignore[method-assign]
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


def test_a_discarded_speculative_rollout_is_made_again_and_never_reported() -> None:
    async def scenario() -> None:
        rollout = _Counting()
        manager = _manager(rollout)
        reported: list[int] = []
        manager._after_rollout = lambda rid, groups, seconds: reported.append(rid)  # type: ignore[method-assign]
        await manager.start_early(0, speculative=True)
        await asyncio.sleep(0)
        assert manager.speculative_early == 0
        assert await manager.discard_early()
        assert rollout.cancelled and manager.speculative_early is None and reported == []
        assert not await manager.discard_early()  # once
        rollout.release.set()
        assert await manager.generate(0) == [["rollout 0"]]
        assert rollout.made == [0, 0] and reported == [0]

    asyncio.run(scenario())


def test_a_kept_speculative_rollout_is_reported_when_the_loop_takes_it() -> None:
    async def scenario() -> None:
        rollout = _Counting()
        manager = _manager(rollout)
        reported: list[tuple[int, float]] = []
        manager._after_rollout = lambda rid, groups, seconds: reported.append((rid, seconds))  # type: ignore[method-assign]
        await manager.start_early(0, speculative=True)
        rollout.release.set()
        await asyncio.sleep(0)
        assert reported == []  # made, not yet taken: no log hook, dump or metrics
        assert await manager.generate(0) == [["rollout 0"]]
        assert reported == [(0, 0.5)] and manager.speculative_early is None and rollout.made == [0]

    asyncio.run(scenario())

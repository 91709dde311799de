"""The end of a run whose trainer node was lost: which loss ended it, and what the records say.

The loss itself, on real nodes, is tests/integration/test_e2e_two_nodes_netns.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tether.records.progress import RunProgress
from tether.records.run_dir import RunDir, model_steps, read_jsonl
from tether.run.nodes.trainer_loss import TRAINER_NODE_LOST_EXIT, TrainerNodeLost, end_run, find_lost
from tether.runtime.errors import ActorDied

LOST = TrainerNodeLost("node-b", "2 heartbeat(s) in a row missed", ["trainer-node1"])


class Pool:
    def __init__(self, lost: TrainerNodeLost | None) -> None:
        self.lost = lost

    def lost_node(self) -> TrainerNodeLost | None:
        return self.lost


def test_the_loss_is_found_raised_in_a_group_or_from_a_pool() -> None:
    group = BaseExceptionGroup("loop", [ValueError("x"), ExceptionGroup("calls", [LOST])])
    assert find_lost(group, []) is LOST
    # The supervisor's report of the lost job's exit ended the run first: the pool knows.
    died = ExceptionGroup("loop", [ActorDied("trainer-node1", reason="node agent lost: ...")])
    assert find_lost(died, [Pool(None), Pool(LOST)]) is LOST
    assert find_lost(died, [Pool(None)]) is None
    assert "node 'node-b', which holds trainer ranks (trainer-node1), is lost" in str(LOST)
    # A member naming its own group as the cause (as a TaskGroup's re-raise can) is no loop.
    inner = ValueError("bad prompt data")
    cyclic = ExceptionGroup("loop", [inner])
    inner.__cause__ = cyclic
    assert find_lost(cyclic, []) is None


def _steps(run_dir: RunDir, steps: range) -> None:
    for step in steps:
        run_dir.trained_samples({"step": step, "trained_at_version": step, "samples": []})


def _checkpoint(root: Path, step: int, *, complete: bool) -> Path:
    """A checkpoint directory as a save leaves it: renamed into place when complete, else `.tmp`."""
    path = root / (f"iter_{step:07d}" if complete else f"iter_{step:07d}.tmp")
    (path / "tether").mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    (path / "tether" / "run_state.msgpack").write_bytes(b"")
    return path


def _end(run_dir: RunDir, save: str | None) -> int:
    return asyncio.run(end_run(LOST, save, run_dir, RunProgress(0, 0, "plain")))


def _events(run_dir: RunDir) -> list[dict[str, Any]]:
    return read_jsonl(run_dir.path / "events.jsonl")


def test_the_run_ends_at_the_last_complete_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, save = RunDir(tmp_path / "run"), tmp_path / "ckpt"
    _steps(run_dir, range(4))
    done = _checkpoint(save, 1, complete=True)
    _checkpoint(save, 3, complete=False)  # the save the loss cut short
    (save / "latest_checkpointed_iteration.txt").write_text("1")
    assert _end(run_dir, str(save)) == TRAINER_NODE_LOST_EXIT
    failed = _events(run_dir)[-1]
    assert (failed["event"], failed["node"], failed["jobs"]) == ("failed", "node-b", ["trainer-node1"])
    assert (failed["checkpoint"], failed["checkpoint_step"]) == (str(done), 1)
    assert model_steps(read_jsonl(run_dir.samples_path)).steps == [0, 1]
    err = capsys.readouterr().err
    assert err.startswith("tether run: node 'node-b'") and f"the last complete checkpoint is {done}" in err


def test_without_save_nothing_is_discarded_and_the_message_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = RunDir(tmp_path / "run")
    _steps(run_dir, range(2))
    assert _end(run_dir, None) == TRAINER_NODE_LOST_EXIT
    failed = _events(run_dir)[-1]
    assert (failed["checkpoint"], failed["checkpoint_step"]) == (None, None)
    assert model_steps(read_jsonl(run_dir.samples_path)).steps == [0, 1]
    assert "no checkpoint was saved (--save unset)" in capsys.readouterr().err

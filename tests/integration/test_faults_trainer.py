"""Trainer faults and resume: a killed rank ends the run cleanly; --load continues it exactly.

The tests start `tether run` as real processes and hurt only their own descendants: kill -9
one trainer rank mid-run (the run must stop every process, exit 1 and name the failed rank
with its log tail), resume from the last checkpoint (the same samples per step as an
uninterrupted run, the engines brought to the checkpoint's weights first), and resume from
a directory whose newest checkpoint has a truncated shard (the previous one is used, and
the run says so).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.e2e import Workspace, check_clean_exit, jsonl, tether

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker, which tether writes

STEPS = 16


def flags(ws: Workspace, run: Path, *extra: str) -> list[str]:
    return ws.flags(
        run,
        "--num-rollout",
        str(STEPS),
        "--rollout-seed",
        "7",
        "--rollout-shuffle",
        "--save-interval",
        "1",
        *extra,
    )


@pytest.fixture(scope="module")
def baseline(ws: Workspace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run that saves every step; its run directory (checkpoints in `ckpt/`)."""
    root = tmp_path_factory.mktemp("baseline")
    tether("run", *flags(ws, root / "run", "--save", str(root / "ckpt")))
    return root


def trained(run: Path) -> dict[int, dict[str, Any]]:
    """Per step: the (index, group index) of every trained sample, and the version trained at."""
    return {
        r["step"]: {
            "samples": [(s[0], s[1]) for s in r["samples"]],
            "version": r["trained_at_version"],
        }
        for r in jsonl(run / "samples.jsonl")
    }


def events(run: Path) -> list[dict[str, Any]]:
    return jsonl(run / "events.jsonl")


def check_resumed(run: Path, base: Path, from_step: int) -> None:
    """The resumed run trained exactly what the uninterrupted one did after `from_step`, and
    the engines served the checkpoint's weights before the first resumed step."""
    steps = trained(run)
    assert sorted(steps) == list(range(from_step + 1, STEPS))
    expected = trained(base)
    for step, record in steps.items():
        assert record == expected[step], f"step {step} differs from the uninterrupted run"
    evs = events(run)
    names = [e["event"] for e in evs]
    resumed = evs[names.index("resumed")]
    assert resumed["rollout_id"] == from_step
    # The checkpoint after step k holds weights v(k+1); they are synced before the loop starts.
    assert resumed["version"] == from_step + 1
    first_sync = evs[names.index("weight_sync")]
    assert first_sync["version"] == resumed["version"]
    assert names.index("resumed") < names.index("weight_sync") < names.index("ready")
    ledger = jsonl(run / "ledger.jsonl")
    assert ledger[0]["version"] == resumed["version"] and ledger[0]["ok"]
    assert set(ledger[0]["engine_versions"].values()) == {resumed["version"]}
    assert steps[from_step + 1]["version"] == resumed["version"]
    assert names[-1] == "finished"


def rank_pid(run: Path, run_pid: int, rank: int) -> tuple[int, list[psutil.Process]]:
    """The pid of trainer rank `rank` (the worker itself, not torchrun or the supervisor's
    shim), checked to be a descendant of the run this test started; and all descendants."""
    pid = json.loads((run / "trainer" / f"rank_{rank:05d}.json").read_text())["pid"]
    descendants = psutil.Process(run_pid).children(recursive=True)
    match = [p for p in descendants if p.pid == pid]
    assert match, f"rank {rank} (pid {pid}) is not a descendant of the run (pid {run_pid})"
    # The rank itself: not its torchrun agent nor a shim. Forked from torchrun's forkserver
    # (train/rank/zygote.py), it shows the command a spawned rank has, not the forkserver's.
    line = match[0].cmdline()
    assert not any("tether.train.rank.torchrun" in arg or arg.endswith("shim.py") for arg in line)
    assert line[1:4] == ["-u", "-m", "tether.train.rank.worker"], line
    return pid, descendants


def test_killed_rank_stops_the_run_then_resume_continues_it(
    ws: Workspace, baseline: Path, tmp_path: Path, run_dir: Path
) -> None:
    run, ckpt = run_dir, tmp_path / "ckpt"
    with open(tmp_path / "tether.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tether", "run", *flags(ws, run, "--save", str(ckpt))],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 120
        samples = run / "samples.jsonl"
        while not (samples.exists() and len(samples.read_text().splitlines()) >= 3):
            assert proc.poll() is None, f"the run exited {proc.returncode} before the kill"
            assert time.monotonic() < deadline, "timed out waiting for the first steps"
            time.sleep(0.05)  # polling a file another process writes; the condition is the sync
        pid, descendants = rank_pid(run, proc.pid, 1)
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "tether.out").read_text()
    final = output[output.rindex("tether run: ") :]
    # The exit message names the torchrun job of the rank, and its log tail the rank itself.
    assert "trainer-node0" in final and "exited with code 1" in final
    assert "rank      : 1 (local_rank: 1)" in final and "exitcode  : -9" in final
    failed = [e for e in events(run) if e["event"] == "failed"]
    assert len(failed) == 1 and "trainer-node0" in failed[0]["error"]
    exits = {e["name"]: e for e in events(run) if e["event"] == "process_exit"}
    assert (exits["trainer-node0"]["returncode"], exits["trainer-node0"]["expected"]) == (1, False)
    for child in descendants:  # every engine, rank, torchrun agent and shim is gone
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child

    # Resume from the last complete checkpoint: the rest of the run, sample for sample.
    killed = trained(run)
    latest = int((ckpt / TRACKER).read_text())
    assert latest >= 1 and latest + 1 < STEPS
    expected = trained(baseline / "run")
    for step in range(latest + 1):
        assert killed[step] == expected[step]
    resumed = tmp_path / "resumed"
    tether("run", *flags(ws, resumed, "--save", str(ckpt), "--load", str(ckpt)))
    check_resumed(resumed, baseline / "run", latest)
    check_clean_exit(resumed)
    assert int((ckpt / TRACKER).read_text()) == STEPS - 1


def test_truncated_newest_checkpoint_falls_back_to_the_previous(
    ws: Workspace, baseline: Path, tmp_path: Path, run_dir: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline / "ckpt", ckpt)
    newest = ckpt / f"iter_{STEPS - 1:07d}"
    assert (ckpt / TRACKER).read_text() == str(STEPS - 1)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    run = run_dir
    done = tether("run", *flags(ws, run, "--load", str(ckpt), "--save", str(tmp_path / "saved")))
    previous = ckpt / f"iter_{STEPS - 2:07d}"
    damaged = [e for e in events(run) if e["event"] == "checkpoint_damaged"]
    assert len(damaged) == 1
    assert damaged[0]["path"] == str(newest) and damaged[0]["used"] == str(previous)
    assert "truncated" in damaged[0]["error"] and "__0_0.distcp" in damaged[0]["error"]
    said = done.stdout + done.stderr
    assert f"checkpoint {newest} is damaged" in said and f"resuming from {previous} instead" in said
    check_resumed(run, baseline / "run", STEPS - 2)

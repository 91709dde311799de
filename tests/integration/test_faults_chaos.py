"""Chaos: one fully-async run (two engines, two trainer ranks, --use-fault-tolerance) through
every fault in turn, resumed with --auto-resume in the same run directory after each one that
ends the head, as SLURM or systemd would.

    attempt 1: engine SIGKILLed, then the other engine SIGSTOPped (both replaced), then a
               trainer rank SIGKILLed (the run ends with exit 1)
    attempt 2: resumes; SIGTERM to the head (checkpoint, exit 0)
    attempt 3: resumes; SIGKILL to the head mid-run (no checkpoint; its processes die with it)
    attempt 4: resumes and runs to the end

The run's own records must then say: each step is in the model exactly once (samples.jsonl
with its discard records), no sample index was trained twice in it, groups are whole, engine
restarts are recorded, ledger versions only increase, and each fault was detected within
interval + timeout + a small margin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from support.e2e import Workspace, jsonl, wait_for

from tether.records.run_dir import model_steps, read_jsonl

STEPS, GROUP = 26, 4
INTERVAL, TIMEOUT = 0.5, 1.0
BOUND = INTERVAL + TIMEOUT + 2.0  # the margin: scheduling on a loaded 2-core machine


def start(ws: Workspace, run: Path, tmp: Path, attempt: int) -> subprocess.Popen[bytes]:
    flags = ws.flags(
        run,
        "--num-rollout",
        str(STEPS),
        "--loop",
        "fully-async",
        "--cpu-devices",
        "4",
        "--rollout-num-gpus",
        "2",
        "--use-fault-tolerance",
        "--rollout-health-check-interval",
        str(INTERVAL),
        "--rollout-health-check-timeout",
        str(TIMEOUT),
        "--max-engine-restarts",
        "5",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp / "weights"),
        "--save",
        str(tmp / "ckpt"),
        "--save-interval",
        "3",
        "--keep-last-checkpoints",
        "2",
        "--auto-resume",
    )
    with open(tmp / f"attempt{attempt}.out", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tether", "run", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def resumed_for_two_steps(ws: Workspace, run: Path, tmp: Path, attempt: int) -> subprocess.Popen[bytes]:
    """Start the next attempt; return once it resumed and trained two more steps."""
    resumed_before = count(run, "resumed")
    proc = start(ws, run, tmp, attempt)
    try:
        wait_for("the resume", lambda: count(run, "resumed") > resumed_before, proc)
        at = live_steps(run)
        wait_for("two more steps", lambda: live_steps(run) >= at + 2, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def events(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(run / "events.jsonl")


def live_steps(run: Path) -> int:
    return len(model_steps(read_jsonl(run / "samples.jsonl")).steps)


def descendants(pid: int, argv: list[str]) -> list[psutil.Process]:
    """Live descendants of `pid` whose command line holds `argv` in order after the interpreter."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            line = child.cmdline()
            if line[1 : 1 + len(argv)] == argv and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def read_addresses_pid(path: Path) -> int:
    """The pid a trainer rank wrote beside its RPC address (train/rank/worker.py)."""
    return int(json.loads(path.read_text())["pid"])


def engines(pid: int) -> list[psutil.Process]:
    return descendants(pid, ["-m", "tether.rollout.cpu_engine"])


def count(run: Path, kind: str) -> int:
    return sum(e["event"] == kind for e in events(run))


def gone(procs: list[psutil.Process]) -> bool:
    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs)


def test_chaos_every_step_once(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    run = run_dir
    faults: list[tuple[str, float]] = []  # (what, when) for the detection checks
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # --- attempt 1: engine faults, then a trainer rank dies ---------------------------
        proc = start(ws, run, tmp_path, 1)
        procs.append(proc)
        wait_for("two steps", lambda: live_steps(run) >= 2, proc)
        first, second = engines(proc.pid)
        first.kill()
        faults.append(("engine killed", time.time()))
        wait_for("the first restart", lambda: count(run, "engine_restarted") >= 1, proc)
        second.suspend()  # SIGSTOP: the engine hangs
        faults.append(("engine hung", time.time()))
        wait_for("the second restart", lambda: count(run, "engine_restarted") >= 2, proc)
        before = live_steps(run)
        wait_for("a step on the new engines", lambda: live_steps(run) > before, proc)
        # The next attempt resumes from a checkpoint: let the first (--save-interval 3) land.
        wait_for("the first checkpoint", lambda: count(run, "checkpoint") >= 1, proc)
        # The last rank, by the pid it published (ranks are forked from torchrun's forkserver,
        # train/rank/zygote.py, so their command line is not `-m tether.train.rank.worker`).
        last = sorted((run / "trainer").glob("rank_*.json"))[-1]
        rank = psutil.Process(read_addresses_pid(last))
        assert rank in psutil.Process(proc.pid).children(recursive=True)
        rank.kill()
        killed_rank_at = time.time()
        assert proc.wait(timeout=120) == 1
        failed = [e for e in events(run) if e["event"] == "failed"]
        assert failed and failed[-1]["time"] - killed_rank_at <= BOUND + 3.0, failed
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE

        # --- attempt 2: resume, then SIGTERM: checkpoint and stop ----------------------------
        proc = resumed_for_two_steps(ws, run, tmp_path, 2)
        procs.append(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert events(run)[-1]["event"] == "stopped"
        # The stop's checkpoint is of the step boundary it stopped at: its own ("signal"), or the
        # interval save that was under way when the signal came, which answers it (same boundary).
        attempt = events(run)[max(i for i, e in enumerate(events(run)) if e["event"] == "start") :]
        stop_checkpoint = [e for e in attempt if e["event"] == "checkpoint"][-1]
        deferred = [e for e in attempt if e["event"] == "checkpoint_deferred"]
        assert stop_checkpoint["reason"] == "signal" or (
            deferred and stop_checkpoint["rollout_id"] == deferred[-1]["step_under_way"] - 1
        ), attempt
        assert stop_checkpoint["rollout_id"] == max(model_steps(read_jsonl(run / "samples.jsonl")).steps)

        # --- attempt 3: resume, then SIGKILL the head mid-run ------------------------------
        proc = resumed_for_two_steps(ws, run, tmp_path, 3)
        procs.append(proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not gone(children):  # every engine and rank dies with its head
            assert time.monotonic() < deadline, [c for c in children if c.is_running()]
            time.sleep(0.05)

        # --- attempt 4: resume and finish ----------------------------------------------------
        proc = start(ws, run, tmp_path, 4)
        procs.append(proc)
        assert proc.wait(timeout=300) == 0, (tmp_path / "attempt4.out").read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    evs = events(run)
    assert evs[-1]["event"] == "finished"
    # Each step is in the model exactly once; what a resume dropped is recorded as discarded.
    records = jsonl(run / "samples.jsonl")
    told = model_steps(records)
    assert told.steps == list(range(STEPS)) and told.duplicates == []
    assert told.discarded, "the head SIGKILL left steps after the last checkpoint"
    # No sample index trained twice in the model; every group whole.
    live = {r["step"]: r for r in records if "step" in r}
    indices = [s[0] for r in live.values() for s in r["samples"]]
    assert len(indices) == len(set(indices)), "a sample index was trained twice"
    groups: dict[int, int] = {}
    for r in live.values():
        for s in r["samples"]:
            groups[s[1]] = groups.get(s[1], 0) + 1
    assert set(groups.values()) == {GROUP}, "a group was split"
    # Restarts and resumes are recorded.
    assert count(run, "engine_restarted") >= 2 and count(run, "resumed") == 3
    # Ledger versions only increase, across every restart of the head.
    versions = [e["version"] for e in jsonl(run / "ledger.jsonl")]
    assert versions == sorted(set(versions)), versions
    # Each engine fault was found within interval + timeout + margin.
    failures = [e for e in evs if e["event"] == "engine_failed"]
    assert len(failures) >= 2
    for (what, when), failure in zip(faults, failures, strict=False):
        assert failure["time"] - when <= BOUND, (what, failure)
        assert failure["detection_s"] <= BOUND, (what, failure)
    # Retention kept the newest two checkpoints, and said what it deleted.
    kept = sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*"))
    assert len(kept) == 2 and kept[-1] == f"iter_{STEPS - 1:07d}", kept
    assert count(run, "checkpoint_deleted") >= 3
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m.get("step", -1) >= 0]
    assert metrics and metrics[-1]["step"] == STEPS - 1

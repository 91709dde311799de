"""Engine faults under --use-fault-tolerance: killed and hung engines are replaced mid-run.

The tests start `tether run` as a real process and hurt only its own descendants (found from
the pid the test started): kill -9 the engine three times, or SIGSTOP it once. The run must
finish, train every sample at most once, and every restarted engine must serve the current
weight version before its first request.
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
import pytest
from support.e2e import Workspace, jsonl, wait_for

INTERVAL, TIMEOUT = 0.5, 1.0


def events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    return jsonl(path) if path.exists() else []


def output(run: Path) -> str:
    path = run.parent / "tether.out"
    return path.read_text()[-6000:] if path.exists() else ""


def engine_pid(run_pid: int) -> int | None:
    """The CPU engine among the descendants of the run this test started."""
    try:
        children = psutil.Process(run_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            argv = child.cmdline()
            # the engine itself, not the supervisor's shim that owns its process group
            if argv[1:3] == ["-m", "tether.rollout.cpu_engine"] and child.status() != psutil.STATUS_ZOMBIE:
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


def start_run(ws: Workspace, run: Path, tmp: Path, steps: int, *extra: str) -> subprocess.Popen[bytes]:
    flags = ws.flags(
        run,
        "--num-rollout",
        str(steps),
        "--loop",
        "fully-async",
        "--use-fault-tolerance",
        "--rollout-health-check-interval",
        str(INTERVAL),
        "--rollout-health-check-timeout",
        str(TIMEOUT),
        "--rollout-health-check-first-wait",
        "120",
        "--max-engine-restarts",
        "5",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp / "weights"),
        *extra,
    )
    with open(tmp / "tether.out", "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tether", "run", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def steps_done(run: Path) -> int:
    path = run / "samples.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def check_samples(run: Path, steps: int) -> list[dict[str, Any]]:
    records = jsonl(run / "samples.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    indices = [s[0] for r in records for s in r["samples"]]
    assert len(indices) == len(set(indices)), "a sample was trained twice"
    groups = {s[1] for r in records for s in r["samples"]}
    assert len(groups) * 4 == len(indices)  # every trained group is whole
    return records


def test_engine_killed_three_times(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    run = run_dir
    proc = start_run(ws, run, tmp_path, 14)
    try:
        wait_for("the first steps", lambda: steps_done(run) >= 2, proc)
        for kill in range(1, 4):
            pid = engine_pid(proc.pid)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(
                f"restart {kill}",
                lambda k=kill: sum(e["event"] == "engine_restarted" for e in events(run)) >= k,
                proc,
            )
            before = steps_done(run)
            wait_for("a step on the new engine", lambda b=before: steps_done(run) > b, proc)
        assert proc.wait(timeout=180) == 0, output(run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = check_samples(run, 14)
    evs = events(run)
    restarts = [e for e in evs if e["event"] == "engine_restarted"]
    assert len(restarts) == 3
    # Before its first request, each restarted engine was brought to the version then served.
    caught = [e for e in evs if e["event"] == "engine_caught_up"]
    syncs = [e for e in evs if e["event"] == "weight_sync"]
    for restart in restarts:
        served = max((s["version"] for s in syncs if s["time"] < restart["time"]), default=0)
        assert restart["version"] == served
        if served:
            assert any(c["version"] == served and c["time"] <= restart["time"] for c in caught)
    # and no sample after the first sync came from the initial weights
    late = [s for r in records if r["trained_at_version"] >= 3 for s in r["samples"]]
    assert late and all("default" not in s[2] for s in late)
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m.get("step", -1) >= 0]
    assert metrics[-1]["ft/engine_restarts"] == 3


def test_engine_hung_is_detected_and_replaced(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    """A hang is found within interval + timeout, also when it comes right after a restart:
    heartbeats start as soon as the engine is ready, not after --rollout-health-check-first-wait
    (120 s here)."""
    run = run_dir
    proc = start_run(ws, run, tmp_path, 8)
    bound = INTERVAL + TIMEOUT + 2.0  # plus scheduling slack on a loaded 2-core machine
    stopped: list[int] = []
    try:
        wait_for("the first step", lambda: steps_done(run) >= 1, proc)
        for hang in range(1, 3):
            if hang == 2:
                wait_for(
                    "the restart", lambda: any(e["event"] == "engine_restarted" for e in events(run)), proc
                )
            pid = engine_pid(proc.pid)
            assert pid is not None and pid not in stopped
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            stopped_at = time.time()
            wait_for(
                f"hang {hang} detected",
                lambda h=hang: sum(e["event"] == "engine_failed" for e in events(run)) >= h,
                proc,
            )
            failed = [e for e in events(run) if e["event"] == "engine_failed"][hang - 1]
            assert failed["time"] - stopped_at <= bound, failed
            assert failed["detection_s"] <= bound, failed
        assert proc.wait(timeout=180) == 0, output(run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    check_samples(run, 8)
    for pid in stopped:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert sum(e["event"] == "engine_restarted" for e in events(run)) == 2
    assert json.loads((run / "receipt.json").read_text())["config"]["fault_tolerance"]["use_fault_tolerance"]


@pytest.mark.sglang
def test_engine_killed_behind_the_sglang_router(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    """--use-sglang-router: the killed engine leaves the router's worker list and comes back to
    it at the served version; the fully-async loop's pauses and aborts reach the engine itself
    (the router answers 404 to them), and every step trains once."""
    from support.engines import find_sglang_python

    python, missing = find_sglang_python()
    if python is None:
        pytest.skip(f"real SGLang unavailable: {missing}")
    run = run_dir
    proc = start_run(ws, run, tmp_path, 6, "--use-sglang-router")
    try:
        wait_for("the first steps", lambda: steps_done(run) >= 2, proc)
        pid = engine_pid(proc.pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for("the restart", lambda: any(e["event"] == "engine_restarted" for e in events(run)), proc)
        assert proc.wait(timeout=180) == 0, output(run)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    check_samples(run, 6)
    evs = events(run)
    order = [e["event"] for e in evs if e["event"] in ROUTER_CHANGES]
    assert order == ["router_worker_removed", "router_worker_added", "engine_restarted"]
    removed, added = (next(e for e in evs if e["event"] == kind) for kind in ROUTER_CHANGES[:2])
    assert removed["url"] == added["url"] and removed["engine"] == added["engine"] == "engine0"
    restart = next(e for e in evs if e["event"] == "engine_restarted")
    syncs = [s["version"] for s in evs if s["event"] == "weight_sync" and s["time"] < added["time"]]
    assert restart["version"] == max(syncs, default=0)
    assert "HTTP 404" not in output(run)


ROUTER_CHANGES = ("router_worker_removed", "router_worker_added", "engine_restarted")

"""bin/slurm/tether.sbatch under real SLURM: sbatch, srun, scancel and requeue on a two-node cluster.

The cluster (tests/support/slurm_cluster.py) runs node-a and node-b on this machine, each slurmd in its
own UTS namespace, so a process sees the hostname of the node SLURM started it on. The script runs
as submitted (`sbatch --nodes=2 bin/slurm/tether.sbatch FLAGS`): SLURM starts it on node-a, the
head and the trainer's ranks run there, and `srun` starts the agent on node-b, which runs the
engine. The inventory gives node-a 127.0.0.1 and node-b 127.0.0.2 (both loopback), so the plan's
addresses stay distinct while nothing leaves the machine.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import REPO
from support.e2e import Workspace, jsonl
from support.net import free_port_block
from support.slurm_cluster import FINAL_STATES, SlurmCluster, slurm_cluster

from tether.records.run_dir import model_steps, read_jsonl

__all__ = ["slurm_cluster"]  # the fixture, used by name

SCRIPT = REPO / "bin" / "slurm" / "tether.sbatch"
TETHER = REPO / "bin" / "tether"
JOB_TIMEOUT = 300.0

# A reward that waits before it answers, so a step lasts about 4 x the delay (a group's four
# samples are scored one after another) while the CPU stays free: a signal lands mid-run without
# hundreds of steps. The delay is read from a file at every call, so a test can speed up the
# run once its signal has landed. The head imports it by path (--custom-rm-path).
PACED_REWARD = """\
import asyncio
import os
from pathlib import Path


async def paced_reward(args, sample):
    pace = Path(os.environ.get("PACED_REWARD_FILE", "/nonexistent"))
    await asyncio.sleep(float(pace.read_text()) if pace.exists() else 0.0)
    # Differs between the samples of a group, so every step has a gradient.
    return float(sum(sample.tokens[-sample.response_length :]) % 5) / 4.0
"""


@pytest.fixture(scope="module")
def ws(ws: Workspace) -> Workspace:
    """The shared workspace (tests/conftest.py) with the paced reward these runs use."""
    (ws.root / "paced_reward.py").write_text(PACED_REWARD)
    return ws


def processes_writing(log: Path) -> list[int]:
    """PIDs of the processes whose stdout is `log` (a process's output goes to its log)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "fd" / "1") == str(log):
                pids.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def seconds(duration: str) -> int:
    """SLURM's [D-]HH:MM:SS (RunTime, TimeLimit) in seconds."""
    days, _, clock = duration.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


class SlurmRun:
    """One tether run submitted as a SLURM job, and what it leaves behind."""

    def __init__(self, cluster: SlurmCluster, ws: Workspace, root: Path) -> None:
        self.cluster = cluster
        self.ws = ws
        self.root = root
        self.run_dir = root / "run"
        self.inventory = root / "inventory.json"
        nodes = [
            {"hostname": cluster.nodes[0], "address": "127.0.0.1"},
            {"hostname": cluster.nodes[1], "address": "127.0.0.2"},
        ]
        self.inventory.write_text(json.dumps({"nodes": nodes}))
        self.ports = free_port_block()
        self.job_id = ""

    def pace(self, delay: float) -> None:
        """Each reward waits `delay` seconds from now on (a step: about 4 x `delay` more)."""
        tmp = self.root / "pace.tmp"
        tmp.write_text(str(delay))
        tmp.replace(self.root / "pace")

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER")}
        env.update(
            TETHER=str(TETHER),
            TETHER_RUN_DIR=str(self.run_dir),
            # Loopback only in tests; on a real cluster the head binds every interface and the
            # agents reach it by the batch node's name (which does not resolve here).
            TETHER_HEAD_BIND_HOST="127.0.0.1",
            TETHER_HEAD_HOST="127.0.0.1",
            PACED_REWARD_FILE=str(self.root / "pace"),
        )
        return env

    def flags(self, steps: int) -> list[str]:
        return [
            *self.ws.flags(self.run_dir),
            "--custom-rm-path",
            f"{self.ws.root / 'paced_reward.py'}:paced_reward",
            "--num-rollout",
            str(steps),
            "--inventory",
            str(self.inventory),
            # Two slots a node: the trainer's two ranks fill node-a, the engine goes to node-b.
            "--cpu-devices",
            "2",
            "--agents-timeout",
            "120",
            "--node-port-first",
            str(self.ports),
            "--node-port-last",
            str(self.ports + 99),
        ]

    def submit(self, steps: int, *options: str, pace: float = 0.0) -> str:
        self.pace(pace)
        self.job_id = self.cluster.submit(
            SCRIPT,
            *self.flags(steps),
            options=["--nodes=2", *options],
            env=self.env(),
            cwd=self.root,
        )
        return self.job_id

    def output(self, chars: int = 8000) -> str:
        path = self.root / f"tether-{self.job_id}.out"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no job output yet)"

    def describe(self) -> str:
        events = self.run_dir / "events.jsonl"
        tail = "\n".join(events.read_text().splitlines()[-15:]) if events.exists() else "(no events)"
        return f"--- tether-{self.job_id}.out\n{self.output()}\n--- events.jsonl (tail)\n{tail}"

    def job(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def wait(self, state: str = "COMPLETED", timeout: float = JOB_TIMEOUT) -> dict[str, str]:
        return self.cluster.wait_job(self.job_id, state, timeout, describe=self.describe)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = JOB_TIMEOUT) -> None:
        """Poll `ready` while the job is queued or runs; fail if it ends first or at the deadline."""
        deadline = time.monotonic() + timeout
        while not ready():
            state = self.job().get("JobState", "")
            assert state not in FINAL_STATES, f"job {state} before {what}\n{self.describe()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s\n{self.describe()}"
            time.sleep(0.25)

    def steps_done(self) -> int:
        return sum(1 for m in read_jsonl(self.run_dir / "metrics.jsonl") if m.get("step", -1) >= 0)

    def leftovers(self) -> list[int]:
        """Processes of this run still alive: those whose output goes to one of its logs."""
        logs = self.run_dir / "logs"
        return [pid for log in sorted(logs.glob("*.log")) for pid in processes_writing(log)]

    def check_ended(self) -> None:
        """The job is over and nothing of the run is left running (the agent stopped its engine)."""
        assert self.leftovers() == [], f"still running: {self.leftovers()}\n{self.describe()}"

    def events(self) -> list[dict[str, Any]]:
        return jsonl(self.run_dir / "events.jsonl")

    def has_event(self, kind: str) -> bool:
        return any(e.get("event") == kind for e in read_jsonl(self.run_dir / "events.jsonl"))

    def check_model_steps(self, expected: list[int]) -> None:
        """samples.jsonl, replayed: every step in the model exactly once."""
        found = model_steps(read_jsonl(self.run_dir / "samples.jsonl"))
        assert found.duplicates == [], f"steps trained twice: {found}\n{self.describe()}"
        assert found.steps == expected, f"{found}\n{self.describe()}"

    def check_requeued_once_and_resumed(self, steps: int) -> None:
        """One stop by USR1 with a checkpoint, one requeue, a resume from it, the run to its end."""
        job = self.job()
        assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", job
        out = self.output(chars=10**6)
        assert f"job {self.job_id} (restart 0)" in out and f"job {self.job_id} (restart 1)" in out, out
        assert "USR1: checkpoint, stop, requeue" in out and f"requeueing job {self.job_id}" in out, out
        evs = self.events()
        kinds = [e["event"] for e in evs]
        assert kinds.count("start") == 2 and kinds[-1] == "finished", kinds
        assert "stopped" in kinds, kinds
        first = kinds.index("stopped")
        saved = [e for e in evs[:first] if e["event"] == "checkpoint" and e["reason"] == "signal"]
        assert saved, f"no checkpoint before the stop\n{self.describe()}"
        stopped_after = saved[-1]["rollout_id"]
        assert 0 <= stopped_after < steps - 1, f"the signal did not land mid-run: {saved[-1]}"
        resumed = [e for e in evs[first:] if e["event"] == "resumed"]
        assert len(resumed) == 1 and resumed[0]["rollout_id"] == stopped_after, resumed
        self.check_model_steps(list(range(steps)))
        self.check_ended()
        done = [m["step"] for m in jsonl(self.run_dir / "metrics.jsonl") if m["step"] >= 0]
        assert sorted(set(done)) == list(range(steps)), done


@pytest.fixture
def run(slurm_cluster: SlurmCluster, ws: Workspace, tmp_path: Path) -> Iterator[SlurmRun]:
    run = SlurmRun(slurm_cluster, ws, tmp_path)
    yield run
    # A test that failed early leaves its job behind: cancel it, so the next job gets the nodes,
    # and stop what it left running (its processes: those writing to its logs).
    if run.job_id and run.job().get("JobState") not in FINAL_STATES:
        slurm_cluster.scancel(run.job_id)
        slurm_cluster.wait_job(run.job_id, FINAL_STATES, timeout=60)
    for pid in run.leftovers():
        os.kill(pid, signal.SIGKILL)


def test_two_node_job_runs_head_on_batch_node_and_engine_on_the_other(run: SlurmRun) -> None:
    steps = 3
    run.submit(steps)
    # While the run is up, find its processes by their output (logs/NAME.log) and the node each
    # runs on by its UTS namespace (each slurmd has its own): the hostname a process sees.
    logs = run.run_dir / "logs"
    run.wait_for("trainer", lambda: run.has_event("trainer_ready"))
    engine = processes_writing(logs / "engine0.log")
    trainer = processes_writing(logs / "trainer-node0.log")
    assert engine and trainer, run.describe()
    assert {run.cluster.node_of(pid) for pid in engine} == {"node-b"}, engine
    assert {run.cluster.node_of(pid) for pid in trainer} == {"node-a"}, trainer

    job = run.wait()
    assert job["NodeList"] == "node-a,node-b" and job["BatchHost"] == "node-a", job
    assert job["Restarts"] == "0" and job["ExitCode"] == "0:0", job

    evs = run.events()
    assert evs[-1]["event"] == "finished", run.describe()
    assert [e["nodes"] for e in evs if e["event"] == "agents_ready"] == [["node-b"]]
    engine_urls = [e["url"] for e in evs if e["event"] == "engine_ready"]
    assert engine_urls and all(u.startswith("http://127.0.0.2:") for u in engine_urls), engine_urls

    # The plan: the trainer on node-a (the head's node), the engine on node-b.
    receipt = json.loads((run.run_dir / "receipt.json").read_text())
    plan = receipt["plan"]
    hosts = {n["index"]: n["hostname"] for n in plan["nodes"]}
    assert {hosts[n["node"]] for n in plan["train_groups"][0]["nodes"]} == {"node-a"}
    assert [hosts[p["node"]] for e in plan["engines"] for p in e["parts"]] == ["node-b"]
    assert "--auto-resume" in receipt["argv"]
    assert receipt["hosts"]["head"] == "node-a"  # the head's own hostname: the batch node
    out = run.output(chars=10**6)
    assert f"job {run.job_id} (restart 0) on node-a node-b; head on node-a" in out, out
    assert "agent 'node-b' serving on" in out, out  # srun's task on node-b, into the job's output

    run.check_model_steps(list(range(steps)))
    assert [m["step"] for m in jsonl(run.run_dir / "metrics.jsonl") if m["step"] >= 0] == list(range(steps))
    assert (run.run_dir / "checkpoints" / f"iter_{steps - 1:07d}").is_dir()
    run.check_ended()


def test_usr1_checkpoints_requeues_and_resumes(run: SlurmRun) -> None:
    """`scancel --batch --signal=USR1`: checkpoint, stop, requeue (same job id), resume, finish."""
    steps = 12
    run.submit(steps, pace=0.15)
    run.wait_for("two steps", lambda: run.steps_done() >= 2)
    run.cluster.scancel(run.job_id, "--batch", "--signal=USR1")
    run.wait_for("the requeue", lambda: run.job()["Restarts"] == "1")
    run.pace(0.0)  # the signal has done its work: the rest of the run at full speed
    run.wait()
    run.check_requeued_once_and_resumed(steps)


def test_term_checkpoints_and_ends_the_job(run: SlurmRun) -> None:
    """`scancel --batch --signal=TERM`: checkpoint and stop for good; the job ends COMPLETED."""
    steps = 12
    run.submit(steps, pace=0.15)
    run.wait_for("two steps", lambda: run.steps_done() >= 2)
    run.cluster.scancel(run.job_id, "--batch", "--signal=TERM")
    job = run.wait()
    assert job["Restarts"] == "0" and job["ExitCode"] == "0:0", job
    evs = run.events()
    assert evs[-1]["event"] == "stopped", run.describe()
    saved = [e for e in evs if e["event"] == "checkpoint" and e["reason"] == "signal"]
    assert len(saved) == 1, run.describe()
    last = saved[0]["rollout_id"]
    assert 1 <= last < steps - 1, saved  # mid-run, after the two steps waited for
    assert (run.run_dir / "checkpoints" / f"iter_{last:07d}").is_dir()
    out = run.output(chars=10**6)
    assert "TERM: checkpoint and stop" in out and "requeueing" not in out, out
    # The model on disk holds exactly the steps up to the checkpoint.
    run.check_model_steps(list(range(last + 1)))
    run.check_ended()


def test_time_limit_signal_requeues_by_itself_and_resumes(run: SlurmRun) -> None:
    """The script's `#SBATCH --signal=B:USR1@120` ahead of the time limit: SLURM signals, the run
    checkpoints, the job requeues itself and resumes to the end. No signal comes from the test.

    The job starts with a long limit; once it is training, the limit is cut so that the warning
    is due. slurmctld checks time limits every 30 s (and sends the warning up to that much
    early), so the run must last that long past the cut: about 1 s a step until the requeue.
    Then the limit goes back up, so the second run is not warned again, and runs at full speed.
    """
    steps = 40
    run.submit(steps, "--time=30", pace=0.25)
    assert run.job()["TimeLimit"] == "00:30:00"
    run.wait_for("two steps", lambda: run.steps_done() >= 2)
    elapsed = seconds(run.job()["RunTime"])
    # The warning due at the next check (end - 120 s - 30 s <= now) with room left for the
    # checkpoint before the end, even if that check comes 30 s later.
    limit = math.ceil((elapsed + 90) / 60)
    run.cluster.command("scontrol", "update", f"JobId={run.job_id}", f"TimeLimit={limit}")
    run.wait_for("the requeue", lambda: run.job()["Restarts"] == "1", timeout=120)
    run.cluster.command("scontrol", "update", f"JobId={run.job_id}", "TimeLimit=30")
    run.pace(0.0)
    run.wait()
    run.check_requeued_once_and_resumed(steps)

"""bin/slurm/tether.sbatch on one machine acting as a two-node allocation.

A fake `srun` (and `scontrol`) on PATH start local processes with the SLURM_* variables a real
step would have. The inventory puts node-a at 127.0.0.1 (the batch node: head and trainer
ranks) and node-b at 127.0.0.2 (its agent, started by srun, runs the engine); both addresses
are loopback on Linux, so nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_support import Workspace, jsonl, make_workspace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bin" / "slurm" / "tether.sbatch"
JOB_ID = "4242"

FAKE_SRUN = """#!{python}
# A stand-in for srun: one local process per chosen node, with that node's SLURM variables.
import os, signal, subprocess, sys

argv = sys.argv[1:]
opts = {{}}
while argv and argv[0].startswith("-"):
    key, _, value = argv.pop(0).partition("=")
    opts[key] = value
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write("srun " + " ".join(sys.argv[1:]) + "\\n")
nodes = os.environ["SLURM_JOB_NODELIST"].split(",")
chosen = opts["--nodelist"].split(",") if "--nodelist" in opts else nodes
chosen = chosen[: int(opts.get("--nodes") or len(chosen))]
procs = []
for rank, node in enumerate(chosen):
    env = dict(os.environ, SLURMD_NODENAME=node, SLURM_NODEID=str(nodes.index(node)),
               SLURM_PROCID=str(rank), SLURM_STEP_ID="0", SLURM_STEP_NUM_NODES=str(len(chosen)))
    proc = subprocess.Popen(argv, env=env)
    procs.append(proc)
    with open(os.environ["FAKE_SLURM_PIDS"], "a") as pids:
        pids.write(f"{{proc.pid}}\\n")

def forward(signum, frame):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
codes = [proc.wait() for proc in procs]
sys.exit(next((c for c in codes if c != 0), 0) % 256)
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# A stand-in for scontrol: `show hostnames LIST` (comma lists only) and `requeue JOB`.
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
case "$1 ${2:-}" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  "requeue "*) ;;
  *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""


def free_port_block(size: int = 100) -> int:
    """The first port of `size` consecutive ports free on 127.0.0.1 and 127.0.0.2."""
    # Below the ephemeral range (where connections get their local ports) and above the
    # default 20000-29999 that other runs on this machine use.
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(50):
        first = rng.randrange(30000, max(30001, ephemeral - size))
        if all(port_free(host, p) for host in ("127.0.0.1", "127.0.0.2") for p in range(first, first + 10)):
            return first
    raise AssertionError("no free block of ports on 127.0.0.1/127.0.0.2")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return make_workspace(tmp_path_factory.mktemp("slurm"))


class FakeCluster:
    """The fake SLURM commands, the allocation's variables, and the processes they started."""

    def __init__(self, root: Path, ws: Workspace) -> None:
        self.root = root
        self.ws = ws
        self.bin = root / "fakebin"
        self.bin.mkdir()
        (self.bin / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
        (self.bin / "scontrol").write_text(FAKE_SCONTROL)
        for tool in ("srun", "scontrol"):
            (self.bin / tool).chmod(0o755)
        self.log = root / "slurm.log"
        self.pids = root / "slurm.pids"
        self.run_dir = root / "run"
        self.inventory = root / "inventory.json"
        nodes = [
            {"hostname": "node-a", "address": "127.0.0.1"},
            {"hostname": "node-b", "address": "127.0.0.2"},
        ]
        self.inventory.write_text(json.dumps({"nodes": nodes}))
        self.ports = free_port_block()

    def env(self, restart: int = 0) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TETHER"))}
        env.update(
            PATH=f"{self.bin}:{env['PATH']}",
            SLURM_JOB_ID=JOB_ID,
            SLURM_JOB_NODELIST="node-a,node-b",
            SLURM_NNODES="2",
            SLURMD_NODENAME="node-a",
            SLURM_NODEID="0",
            SLURM_SUBMIT_DIR=str(self.root),
            SLURM_RESTART_COUNT=str(restart),
            TETHER=str(Path(sys.executable).parent / "tether"),
            TETHER_RUN_DIR=str(self.run_dir),
            # Loopback only in tests; a real cluster binds every interface (the default).
            TETHER_HEAD_BIND_HOST="127.0.0.1",
            TETHER_HEAD_HOST="127.0.0.1",
            FAKE_SLURM_LOG=str(self.log),
            FAKE_SLURM_PIDS=str(self.pids),
        )
        return env

    def flags(self, steps: int) -> list[str]:
        return [
            *self.ws.flags(self.run_dir),
            "--num-rollout",
            str(steps),
            "--inventory",
            str(self.inventory),
            # Two slots a node: the trainer's two ranks fill node-a, the engine goes to node-b.
            "--cpu-devices",
            "2",
            "--agents-timeout",
            "120",
            # Ports from a block free right now, so a run beside other tests does not collide.
            "--node-port-first",
            str(self.ports),
            "--node-port-last",
            str(self.ports + 99),
        ]

    def start(self, steps: int, restart: int = 0) -> subprocess.Popen[bytes]:
        # --output=slurm-%j.out with --open-mode=append, as sbatch would write it.
        with open(self.root / f"slurm-{JOB_ID}.out", "ab") as out:
            return subprocess.Popen(
                ["bash", str(SCRIPT), *self.flags(steps)],
                env=self.env(restart),
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, proc: subprocess.Popen[bytes], timeout: float = 300) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            raise AssertionError(f"tether.sbatch did not finish in {timeout}s\n{self.output()}") from None

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop what this test started: the script's process group, then the fake srun's tasks."""
        for pid in [proc.pid, *self.started_pids()]:
            try:
                os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def started_pids(self) -> list[int]:
        return [int(p) for p in self.pids.read_text().split()] if self.pids.exists() else []

    def output(self) -> str:
        text = (self.root / f"slurm-{JOB_ID}.out").read_text(errors="replace")
        return text[-6000:]

    def slurm_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def cluster(tmp_path: Path, ws: Workspace) -> FakeCluster:
    return FakeCluster(tmp_path, ws)


def events(run: Path) -> list[dict]:
    return jsonl(run / "events.jsonl")


def test_sbatch_two_nodes_head_and_agent(cluster: FakeCluster) -> None:
    proc = cluster.start(steps=2)
    rc = cluster.wait(proc)
    assert rc == 0, cluster.output()
    run = cluster.run_dir

    # scontrol expanded the node list; srun started exactly one agent, on node-b.
    calls = cluster.slurm_calls()
    assert calls[0] == "scontrol show hostnames node-a,node-b"
    sruns = [c for c in calls if c.startswith("srun ")]
    assert len(sruns) == 1 and "--nodes=1" in sruns[0] and "--nodelist=node-b" in sruns[0]
    assert not any("requeue" in c for c in calls)

    # The plan put the trainer on node-a (the head's node) and the engine on node-b.
    receipt = json.loads((run / "receipt.json").read_text())
    plan = receipt["plan"]
    hosts = {n["index"]: n["hostname"] for n in plan["nodes"]}
    assert {hosts[n["node"]] for n in plan["train_groups"][0]["nodes"]} == {"node-a"}
    assert [hosts[p["node"]] for e in plan["engines"] for p in e["parts"]] == ["node-b"]
    assert "--auto-resume" in receipt["argv"] and receipt["config"]["run"]["auto_resume"] is True

    # The head waited for node-b's agent, whose engine served at node-b's address.
    evs = events(run)
    assert {"event": "agents_ready", "nodes": ["node-b"]}.items() <= next(
        e for e in evs if e["event"] == "agents_ready"
    ).items()
    engine_urls = [e["url"] for e in evs if e["event"] == "engine_ready"]
    assert engine_urls and all(u.startswith("http://127.0.0.2:") for u in engine_urls)
    assert evs[-1]["event"] == "finished"
    assert any(e["event"] == "checkpoint" for e in evs)  # --save is set by the script

    assert [e["version"] for e in jsonl(run / "ledger.jsonl")] == [1, 2]
    assert [m["step"] for m in jsonl(run / "metrics.jsonl") if m["step"] >= 0] == [0, 1]
    assert (run / "head_address").read_text().startswith("tcp://127.0.0.1:")
    assert (run / "logs" / "engine0.log").exists()
    # The agent left when the head shut it down: every process the fake srun started is gone.
    for pid in cluster.started_pids():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sbatch_usr1_checkpoints_requeues_and_resumes(cluster: FakeCluster) -> None:
    """USR1 (the time-limit warning) → checkpoint, stop, requeue; the requeued job resumes."""
    steps = 12  # enough that the signal lands mid-run
    proc = cluster.start(steps=steps)
    try:
        deadline = time.monotonic() + 240
        metrics = cluster.run_dir / "metrics.jsonl"
        # Signal once the first step is done, so there is a step to checkpoint.
        while not (metrics.exists() and any(m["step"] >= 0 for m in jsonl(metrics))):
            assert proc.poll() is None, cluster.output()
            assert time.monotonic() < deadline, cluster.output()
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@120` sends to the batch shell
        rc = cluster.wait(proc)
    finally:
        if proc.poll() is None:
            cluster.kill(proc)
    assert rc == 0, cluster.output()
    evs = events(cluster.run_dir)
    assert [e["event"] for e in evs][-1] == "stopped"
    saved = [e for e in evs if e["event"] == "checkpoint" and e["reason"] == "signal"]
    assert saved, cluster.output()
    assert f"scontrol requeue {JOB_ID}" in cluster.slurm_calls()
    stopped_after = saved[-1]["rollout_id"]

    # SLURM starts the requeued job again: same job id, so the same run directory and checkpoints.
    rc = cluster.wait(cluster.start(steps=steps, restart=1))
    assert rc == 0, cluster.output()
    evs = events(cluster.run_dir)
    resumed = [e for e in evs if e["event"] == "resumed"]
    assert resumed and resumed[-1]["rollout_id"] == stopped_after
    assert evs[-1]["event"] == "finished"
    done = [m["step"] for m in jsonl(cluster.run_dir / "metrics.jsonl") if m["step"] >= 0]
    assert sorted(set(done)) == list(range(steps))
    assert cluster.slurm_calls().count(f"scontrol requeue {JOB_ID}") == 1

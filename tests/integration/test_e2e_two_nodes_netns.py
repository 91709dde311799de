"""Two nodes for real: node B is a network namespace with its own address.

A veth pair joins the root namespace (node A: the head, and the trainer ranks unless a run
splits them) to a namespace made for this module (node B: `tether agent`, started inside it
with `ip netns exec`, and the engine), the layout bin/slurm/tether.sbatch uses. The pair's two
addresses are a private /30 that exists only between its ends, so nothing that advertises or
dials 127.0.0.1 can work by accident, and no traffic leaves the pair. Nothing sets
GLOO_SOCKET_IFNAME: tether binds every process group and TCP store to the node's planned
address by itself.

Each run checks that it finished, that the engine served at B's address, and that on every
step the engine's log-probs of the sampled tokens equal the trainer's (the check a one-node
run passes in test_e2e_run.py): the weights reached node B intact.

Needs root and iproute2 (`ip`); skipped otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.e2e import Workspace, jsonl
from support.net import free_port_block

from tether.runtime.netif import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env

RUN_TIMEOUT = 300.0
CPU_ENGINE = ["-m", "tether.rollout.cpu_engine"]
TORCHRUN = ["-m", "tether.train.rank.torchrun"]


@dataclass(frozen=True)
class TwoNodes:
    """The namespace of node B and both ends of the veth pair."""

    namespace: str
    a: str  # node A's address (the root namespace's end)
    b: str  # node B's address (inside the namespace)
    if_a: str
    if_b: str


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.231.0.0/16 that no interface of this machine has an address in."""
    taken = [
        ipaddress.ip_address(entry.address)
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family == socket.AF_INET
    ]
    rng = random.Random()
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.231.{rng.randrange(256)}.{4 * rng.randrange(64)}/30")
        if not any(ip in net for ip in taken):
            return net
    raise AssertionError("no free /30 in 10.231.0.0/16")


@pytest.fixture(scope="module")
def nodes() -> Iterator[TwoNodes]:
    if os.geteuid() != 0:
        pytest.skip("making a network namespace and a veth pair needs root")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make a network namespace")
    tag = f"{os.getpid() % 10**7}"
    net = _free_subnet()
    first, second = list(net.hosts())
    two = TwoNodes(f"tether-b-{tag}", str(first), str(second), f"tta{tag}", f"ttb{tag}")
    made_namespace = made_link = False
    try:
        steps = [
            ("netns", "add", two.namespace),
            ("link", "add", two.if_a, "type", "veth", "peer", "name", two.if_b, "netns", two.namespace),
            ("addr", "add", f"{two.a}/{net.prefixlen}", "dev", two.if_a),
            ("link", "set", two.if_a, "up"),
            ("-n", two.namespace, "addr", "add", f"{two.b}/{net.prefixlen}", "dev", two.if_b),
            ("-n", two.namespace, "link", "set", two.if_b, "up"),
            ("-n", two.namespace, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot make node B's namespace: `ip {' '.join(step)}`: {done.stderr.strip()}")
            made_namespace = True
            made_link = made_link or step[0] == "link"
        yield two
    finally:
        if made_link:
            _ip("link", "del", two.if_a)  # takes its peer in the namespace with it
        if made_namespace:
            _ip("netns", "del", two.namespace)


def descendants(pid: int, argv: list[str]) -> list[psutil.Process]:
    """Live descendants of `pid` running `python ARGV...` (not the shims that own their groups)."""
    found = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            if child.cmdline()[1 : 1 + len(argv)] == argv and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def listening(proc: psutil.Process) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
    }


class TwoNodeRun:
    """One `tether run` on node A and its `tether agent` inside node B's namespace."""

    def __init__(self, two: TwoNodes, ws: Workspace, root: Path, steps: int, *flags: str) -> None:
        self.two = two
        self.root = root
        self.run = root / "run"
        self.steps = steps
        inventory = root / "inventory.json"
        # A sorts first (lower address): its node hosts the head, and the trainer's first ranks.
        nodes = [{"hostname": "node-a", "address": two.a}, {"hostname": "node-b", "address": two.b}]
        inventory.write_text(json.dumps({"nodes": nodes}))
        ports = free_port_block(hosts=(two.a,))  # the plan's ports on node A's address
        self.flags = ws.flags(
            self.run,
            "--num-rollout",
            str(steps),
            "--inventory",
            str(inventory),
            "--cpu-devices",
            "2",
            "--head-bind-host",
            two.a,
            "--head-port",
            "0",
            "--agents-timeout",
            "120",
            "--node-port-first",
            str(ports),
            "--node-port-last",
            str(ports + 99),
            *flags,
        )
        # The test's own environment, less any socket binding: tether must find the interfaces.
        env = {k: v for k, v in os.environ.items() if k not in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV)}
        self.env = {**env, SECRET_ENV: secret_to_env(new_secret()), "PYTHONUNBUFFERED": "1"}
        self.head: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> TwoNodeRun:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _start(self) -> None:
        with open(self.root / "head.out", "wb") as out:
            self.head = subprocess.Popen(
                [sys.executable, "-m", "tether", "run", *self.flags],
                env={**self.env, "TETHER_NODE_NAME": "node-a"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        address_file = self.run / "head_address"
        self.wait_for(
            "the head's control address", lambda: address_file.exists() and address_file.stat().st_size > 0
        )
        head = address_file.read_text().strip()
        assert head.startswith(f"tcp://{self.two.a}:"), head
        agent = [sys.executable, "-m", "tether", "agent", "--head", head, "--node-name", "node-b"]
        with open(self.root / "agent.out", "wb") as out:
            self.agent = subprocess.Popen(
                ["ip", "netns", "exec", self.two.namespace, *agent, "--run-dir", str(self.run)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def _stop(self) -> None:
        """Stop what this run started, by pid: the head first (it stops its agent), then the agent."""
        for proc in (self.head, self.agent):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def output(self) -> str:
        texts = []
        for name in ("head.out", "agent.out"):
            path = self.root / name
            texts.append(
                f"--- {name}\n" + (path.read_text(errors="replace")[-5000:] if path.exists() else "")
            )
        return "\n".join(texts)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = RUN_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for name, proc in (("head", self.head), ("agent", self.agent)):
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(
                        f"the {name} exited {proc.returncode} waiting for {what}\n{self.output()}"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.output()}")
            time.sleep(0.2)  # polling files and processes of other processes; the condition is the sync

    def finish(self) -> None:
        """The head exits 0 and tells its agent to exit, which then exits 0 too."""
        assert self.head is not None and self.agent is not None
        try:
            assert self.head.wait(timeout=RUN_TIMEOUT) == 0, self.output()
            assert self.agent.wait(timeout=60) == 0, self.output()
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish in time\n{self.output()}") from None

    def events(self) -> list[dict[str, Any]]:
        path = self.run / "events.jsonl"
        return jsonl(path) if path.exists() else []

    def steps_done(self) -> int:
        path = self.run / "metrics.jsonl"
        return sum(1 for m in jsonl(path) if m.get("step", -1) >= 0) if path.exists() else 0

    def plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = json.loads((self.run / "receipt.json").read_text())["plan"]
        return plan

    def check(self, transport: str) -> list[dict[str, Any]]:
        """Every step trained and synced, the engine served each version, and its log-probs of
        the sampled tokens equal the trainer's."""
        ledger = jsonl(self.run / "ledger.jsonl")
        assert [e["version"] for e in ledger] == list(range(1, self.steps + 1))
        for entry in ledger:
            assert entry["ok"] and entry["transport"] == transport, entry
            assert set(entry["engine_versions"].values()) == {entry["version"]}, entry
        metrics = [m for m in jsonl(self.run / "metrics.jsonl") if m.get("step", -1) >= 0]
        assert [m["step"] for m in metrics] == list(range(self.steps))
        for m in metrics:
            assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0, m
            assert m["rollout/version_lag_max"] == 0, m  # the sync loop: the newest weights
            assert m["train/train_rollout_logprob_abs_diff"] < 1e-4, m
        evs = self.events()
        assert evs[0]["event"] == "start" and evs[-1]["event"] == "finished"
        assert next(e for e in evs if e["event"] == "agents_ready")["nodes"] == ["node-b"]
        return metrics

    def engine_node(self) -> str:
        """The node (host name) of the plan's single engine."""
        plan = self.plan()
        hosts = {n["index"]: n["hostname"] for n in plan["nodes"]}
        (engine,) = plan["engines"]
        (part,) = engine["parts"]
        return str(hosts[part["node"]])

    def engine_urls(self) -> list[str]:
        return [e["url"] for e in self.events() if e["event"] == "engine_ready"]


def test_disk_sync_and_engine_replaced_on_node_b(nodes: TwoNodes, ws: Workspace, tmp_path: Path) -> None:
    """Full disk sync to the engine on B; the engine killed there is started again on B (through
    B's agent), with B's interface for its collectives, and serves the current weights."""
    steps = 10  # the kill comes after step 1: the rollouts of the steps after it need the new engine
    flags = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "weights")]
    flags += ["--use-fault-tolerance", "--rollout-health-check-interval", "0.5"]
    flags += ["--rollout-health-check-timeout", "2", "--max-engine-restarts", "2"]
    with TwoNodeRun(nodes, ws, tmp_path, steps, *flags) as run:
        assert run.agent is not None
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        (engine,) = descendants(run.agent.pid, CPU_ENGINE)  # on B: a child of B's agent
        environ = engine.environ()
        assert (environ.get(GLOO_IFNAME_ENV), environ.get(NCCL_IFNAME_ENV)) == (nodes.if_b, f"={nodes.if_b}")
        shim = engine.ppid()  # the process the agent started, which it reports
        engine.kill()
        run.wait_for("the restart", lambda: any(e["event"] == "engine_restarted" for e in run.events()))
        run.finish()
    run.check("disk")
    assert run.engine_node() == "node-b"
    urls = run.engine_urls()
    assert urls and all(u.startswith(f"http://{nodes.b}:") for u in urls), urls
    evs = run.events()
    # B's agent reported both exits: the killed engine's, and its replacement's at the end.
    exits = [e for e in evs if e["event"] == "process_exit" and e["name"] == "engine0"]
    assert [(e["node"], e["pid"] == shim, e["expected"]) for e in exits] == [
        ("node-b", True, False),
        ("node-b", False, True),
    ], exits
    restarted = [e for e in evs if e["event"] == "engine_restarted"]
    assert len(restarted) == 1 and restarted[0]["version"] >= 1


@pytest.mark.parametrize("mode", ["distributed", "delta"])
def test_sync_to_the_engine_on_node_b(nodes: TwoNodes, ws: Workspace, tmp_path: Path, mode: str) -> None:
    """Trainer ranks on A, the engine on B: the gloo update group (`nccl` on CPU) spans the two
    nodes; delta sync writes and reads its files across them."""
    if mode == "distributed":
        flags = ["--update-weight-transport", "nccl"]
    else:
        flags = ["--update-weight-mode", "delta", "--update-weight-transport", "disk"]
        flags += ["--update-weight-disk-dir", str(tmp_path / "w")]
        flags += ["--update-weight-local-checkpoint-dir", str(tmp_path / "local")]
    with TwoNodeRun(nodes, ws, tmp_path, 2, *flags) as run:
        run.finish()
    run.check(mode)
    assert run.engine_node() == "node-b"
    plan = run.plan()
    assert {n["hostname"] for n in plan["train_groups"][0]["nodes"]} == {"node-a"}
    urls = run.engine_urls()
    assert urls and all(u.startswith(f"http://{nodes.b}:") for u in urls), urls


def test_trainer_split_over_both_nodes(nodes: TwoNodes, ws: Workspace, tmp_path: Path) -> None:
    """One trainer rank per node, a pipeline stage each: the trainer's world, Megatron's groups
    and the stage-to-stage sends span the nodes, and stage 1's update group is hosted on B."""
    flags = [
        "--actor-num-nodes",
        "2",
        "--actor-num-gpus-per-node",
        "1",
        "--pipeline-model-parallel-size",
        "2",
    ]
    flags += ["--update-weight-transport", "nccl"]
    with TwoNodeRun(nodes, ws, tmp_path, 2, *flags) as run:
        assert run.head is not None
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        # torchrun on A hosts the rendezvous store, on A's address alone.
        (torchrun,) = descendants(run.head.pid, TORCHRUN)
        rdzv = run.plan()["train_groups"][0]["rdzv_endpoint"]
        port = int(rdzv.rsplit(":", 1)[1])
        assert {addr for addr, p in listening(torchrun) if p == port} == {nodes.a}, listening(torchrun)
        run.finish()
    run.check("distributed")
    plan = run.plan()
    hosts = {n["index"]: n["hostname"] for n in plan["nodes"]}
    assert [hosts[n["node"]] for n in plan["train_groups"][0]["nodes"]] == ["node-a", "node-b"]
    engine_log = (run.run / "logs" / "engine0.log").read_text()
    assert "group 'tether-weights-pp0-" in engine_log and "group 'tether-weights-pp1-" in engine_log

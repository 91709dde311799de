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

import contextlib
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

from tether.records.run_dir import model_steps
from tether.run.nodes.trainer_loss import TRAINER_NODE_LOST_EXIT
from tether.runtime.netif import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env
from tether.train.checkpoint.load_save import validate_checkpoint

RUN_TIMEOUT = 300.0
CPU_ENGINE = ["-m", "tether.rollout.cpu_engine"]
TORCHRUN = ["-m", "tether.train.rank.torchrun"]
# One trainer rank per node, a pipeline stage each.
SPLIT_TRAINER = (
    "--actor-num-nodes",
    "2",
    "--actor-num-gpus-per-node",
    "1",
    "--pipeline-model-parallel-size",
    "2",
)


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
        self.gone: list[subprocess.Popen[bytes]] = []  # agents this test killed, reaped at the end

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
        self.start_agent()

    def start_agent(self) -> None:
        """`tether agent` for node B, inside B's namespace."""
        head = (self.run / "head_address").read_text().strip()
        agent = [sys.executable, "-m", "tether", "agent", "--head", head, "--node-name", "node-b"]
        with open(self.root / "agent.out", "ab") as out:
            self.agent = subprocess.Popen(
                ["ip", "netns", "exec", self.two.namespace, *agent, "--run-dir", str(self.run)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill_agent(self) -> None:
        """SIGKILL node B's agent (its processes die with it)."""
        assert self.agent is not None
        self.agent.kill()
        self.agent.wait()
        self.gone.append(self.agent)
        self.agent = None

    def node_b_processes(self) -> list[psutil.Process]:
        """B's agent and everything under it (its shims, the engine, a zygote)."""
        assert self.agent is not None
        agent = psutil.Process(self.agent.pid)  # `ip netns exec` execs the agent: the same pid
        return [agent, *agent.children(recursive=True)]

    def link_b(self, up: bool) -> None:
        """Take B's end of the veth pair down or up (A's end stays up, with A's own routes)."""
        done = _ip("-n", self.two.namespace, "link", "set", self.two.if_b, "up" if up else "down")
        assert done.returncode == 0, done.stderr

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

    def stop_run(self) -> None:
        """SIGTERM the head, as an operator would: the run stops cleanly, its agent with it."""
        assert self.head is not None
        self.head.send_signal(signal.SIGTERM)
        self.finish()

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

    def check(self, transport: str, *, replaced: bool = False) -> list[dict[str, Any]]:
        """Every step trained and synced, the engine served each version, and its log-probs of
        the sampled tokens equal the trainer's. `replaced`: the only engine was killed and started
        again, so a sync made while it was down reached no engine (its replacement catches up to
        the served version before it serves)."""
        ledger = jsonl(self.run / "ledger.jsonl")
        assert [e["version"] for e in ledger] == list(range(1, self.steps + 1))
        for entry in ledger:
            assert entry["ok"] and entry["transport"] == transport, entry
            served = set(entry["engine_versions"].values())
            assert served == {entry["version"]} or (replaced and not served), entry
        assert set(ledger[-1]["engine_versions"].values()) == {ledger[-1]["version"]}, ledger[-1]
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

    def seen(self, event: str) -> bool:
        return any(e["event"] == event for e in self.events())

    def status(self) -> dict[str, Any]:
        """`tether status --json` of this run, with the run's secret (the live view while it runs)."""
        done = subprocess.run(
            [sys.executable, "-m", "tether", "status", str(self.run), "--json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found


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
        (engine,) = descendants(run.agent.pid, CPU_ENGINE)  # on B: below B's agent
        # Forked from B's secret-less zygote, with B's interface for its collectives (which its
        # log names: a fork's environment does not show in /proc/PID/environ).
        assert "tether.runtime.process.zygote" in psutil.Process(engine.ppid()).cmdline()
        serving = f"collectives: {GLOO_IFNAME_ENV}={nodes.if_b} {NCCL_IFNAME_ENV}=={nodes.if_b}"
        assert serving in (run.run / "logs" / "engine0.log").read_text()
        started = engine.pid  # the process the agent started, which it reports
        engine.kill()
        run.wait_for("the restart", lambda: any(e["event"] == "engine_restarted" for e in run.events()))
        run.finish()
    run.check("disk", replaced=True)
    assert run.engine_node() == "node-b"
    urls = run.engine_urls()
    assert urls and all(u.startswith(f"http://{nodes.b}:") for u in urls), urls
    evs = run.events()
    # B's agent reported both exits: the killed engine's, and its replacement's at the end.
    exits = [e for e in evs if e["event"] == "process_exit" and e["name"] == "engine0"]
    assert [(e["node"], e["pid"] == started, e["expected"]) for e in exits] == [
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
    flags = list(SPLIT_TRAINER)
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


def both_synced(run: TwoNodeRun) -> int:
    """Syncs since engine1 rejoined that reached both engines."""
    path = run.run / "ledger.jsonl"
    rejoined = [e["time"] for e in run.events() if e["event"] == "engine_rejoined"]
    if not rejoined or not path.exists():
        return 0
    return sum(len(e["engine_versions"]) == 2 and e["finished_at"] > rejoined[0] for e in jsonl(path))


def node_loss_flags(tmp_path: Path) -> list[str]:
    """engine0 on A, engine1 on B, disk sync; node agents lost after 2 missed heartbeats (8 s at
    most, the tolerance), engines counted hung only after 10 s without an answer: B's engine is
    lost with its node, not before it as a hung engine."""
    flags = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--heartbeat-misses", "2"]
    flags += ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "weights")]
    flags += ["--use-fault-tolerance", "--rollout-health-check-interval", "1"]
    flags += ["--rollout-health-check-timeout", "10", "--max-engine-restarts", "2"]
    # A sync caught mid-call to B fails after this long, and is retried without B.
    flags += ["--update-weight-request-timeout", "20"]
    return flags


TOLERANCE = 2 * (1.0 + 3.0)  # --heartbeat-misses 2 × (interval + timeout of a heartbeat)


def signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


def test_engine_node_frozen_past_the_tolerance(nodes: TwoNodes, ws: Workspace, tmp_path: Path) -> None:
    """Node B's agent and engine SIGSTOPped until the head has counted B lost, then SIGCONTed:
    the same agent learns from its next heartbeat that it was dropped, stops its old engine
    (which held its ports) and registers again; the head starts engine1 there again, caught up
    to the served version."""
    with TwoNodeRun(nodes, ws, tmp_path, 100_000, *node_loss_flags(tmp_path)) as run:
        assert run.agent is not None
        agent = run.agent
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        (old_engine,) = descendants(agent.pid, CPU_ENGINE)
        frozen = run.node_b_processes()
        signal_all(frozen, signal.SIGSTOP)
        try:
            run.wait_for("engine1 lost", lambda: run.seen("engine_lost"))
            lost_at = run.steps_done()
            run.wait_for("a step without node B", lambda: run.steps_done() > lost_at)
        finally:
            signal_all(frozen, signal.SIGCONT)
        run.wait_for("engine1 rejoined", lambda: run.seen("engine_rejoined"))
        run.wait_for("two syncs to both engines after it", lambda: both_synced(run) >= 2)
        assert not old_engine.is_running() or old_engine.status() == psutil.STATUS_ZOMBIE
        (new_engine,) = descendants(agent.pid, CPU_ENGINE)  # started by the same agent
        assert new_engine.pid != old_engine.pid
        run.stop_run()
    assert run.agent is agent and not run.gone
    assert "registered again" in (tmp_path / "agent.out").read_text()
    check_lost_and_rejoined(run, nodes)
    lost = next(e for e in run.events() if e["event"] == "node_lost")
    assert "heartbeat" in lost["reason"], lost


def test_engine_node_link_down_inside_then_past_the_tolerance(
    nodes: TwoNodes, ws: Workspace, tmp_path: Path
) -> None:
    """B's link down for 2 s, well inside the tolerance: nothing changes (no node or engine
    lost, no restart, no retried sync) and both engines keep getting every sync. Then down for
    10 s, past it: B is lost, the run trains on with engine0; once the link is up, B's agent
    (which gave the head up too and stopped its engine) registers again, and engine1 rejoins
    at the served version."""
    with TwoNodeRun(nodes, ws, tmp_path, 100_000, *node_loss_flags(tmp_path)) as run:
        assert run.agent is not None
        agent = run.agent
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        down = time.monotonic()
        run.link_b(up=False)
        time.sleep(2.0)  # the partition under test, not a wait for anything
        run.link_b(up=True)
        healed, steps = time.time(), run.steps_done()
        run.wait_for(
            "two steps, and the tolerance passed",
            lambda: run.steps_done() >= steps + 2 and time.monotonic() > down + TOLERANCE + 2.0,
        )
        quiet = {"node_lost", "node_joined", "engine_lost", "engine_failed", "engine_restarted", "sync_retry"}
        assert not [e for e in run.events() if e["event"] in quiet]
        path = run.run / "ledger.jsonl"
        assert any(len(e["engine_versions"]) == 2 and e["finished_at"] > healed for e in jsonl(path))

        down = time.monotonic()
        run.link_b(up=False)
        try:
            run.wait_for("engine1 lost", lambda: run.seen("engine_lost"))
            lost_at = run.steps_done()
            run.wait_for(
                "a step without node B, 10 s down",
                lambda: run.steps_done() > lost_at and time.monotonic() > down + 10.0,
            )
        finally:
            run.link_b(up=True)
        run.wait_for("engine1 rejoined", lambda: run.seen("engine_rejoined"))
        run.wait_for("two syncs to both engines after it", lambda: both_synced(run) >= 2)
        run.stop_run()
    assert run.agent is agent and not run.gone  # B's agent stayed up and registered again
    assert "registered again" in (tmp_path / "agent.out").read_text()
    check_lost_and_rejoined(run, nodes)


def test_engine_node_lost_and_rejoined(nodes: TwoNodes, ws: Workspace, tmp_path: Path) -> None:
    """Node B (one of the two engines) loses its agent to SIGKILL mid-run: the head marks B and its
    engine lost, the run trains on with the engine on A, and once an agent for B registers again
    the engine is started there, brought to the served version and routed to. `tether status`
    shows the loss live, and the end from the records. The run is long and stopped by SIGTERM
    once the engine has served after rejoining: how fast steps go does not matter."""
    flags = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]  # engine0 on A, engine1 on B
    flags += ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "weights")]
    flags += ["--use-fault-tolerance", "--rollout-health-check-interval", "0.5"]
    flags += ["--rollout-health-check-timeout", "2", "--max-engine-restarts", "1"]
    with TwoNodeRun(nodes, ws, tmp_path, 100_000, *flags) as run:
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        run.kill_agent()
        run.wait_for("engine1 lost", lambda: run.seen("engine_lost"))
        lost_at = run.steps_done()
        run.wait_for("a step without node B", lambda: run.steps_done() > lost_at)
        live = run.status()
        assert live["source"] == "live" and live["state"] == "running", live
        assert {n["node"]: n["state"] for n in live["nodes"]} == {"node-a": "up", "node-b": "lost"}, live
        assert {e["engine"]: e["state"] for e in live["engines"]} == {"engine0": "serving", "engine1": "lost"}
        run.start_agent()
        run.wait_for("engine1 rejoined", lambda: run.seen("engine_rejoined"))
        run.wait_for("two syncs to both engines after it", lambda: both_synced(run) >= 2)
        run.stop_run()
    check_lost_and_rejoined(run, nodes)


def check_lost_and_rejoined(run: TwoNodeRun, nodes: TwoNodes) -> None:
    """From the records of a run stopped by SIGTERM: every step trained once, no sample twice;
    node B lost once and back once; engine1 lost with it (not a restart) and rejoined at the
    version then served; steps trained meanwhile, and after it every sync reached both engines."""
    evs = run.events()
    kinds = [e["event"] for e in evs]
    assert kinds[-1] == "stopped" and "failed" not in kinds
    # Every step trained once, no sample twice, every trained group whole.
    records = jsonl(run.run / "samples.jsonl")
    steps = len(records)
    assert [r["step"] for r in records] == list(range(steps))
    indices = [s[0] for r in records for s in r["samples"]]
    assert len(indices) == len(set(indices)), "a sample was trained twice"
    assert len({s[1] for r in records for s in r["samples"]}) * 4 == len(indices)
    # B was lost once and came back; engine1 went with it (not counted as a restart) and rejoined.
    nodes_seen = [(e["event"], e["node"]) for e in evs if e["event"] in ("node_lost", "node_joined")]
    assert nodes_seen == [("node_lost", "node-b"), ("node_joined", "node-b")], nodes_seen
    (lost,) = [e for e in evs if e["event"] == "engine_lost"]
    (rejoined,) = [e for e in evs if e["event"] == "engine_rejoined"]
    assert (lost["engine"], lost["node"], rejoined["engine"]) == ("engine1", "node-b", "engine1")
    assert not any(e["event"] == "engine_restarted" for e in evs)
    # Steps trained while engine1 was away: the rollout went on with engine0 alone.
    syncs = [e for e in evs if e["event"] == "weight_sync"]
    assert any(lost["time"] < e["time"] < rejoined["time"] for e in syncs), "no step while B was lost"
    # It rejoined at the version then served, caught up before its first request ...
    served = max((e["version"] for e in syncs if e["time"] < rejoined["time"]), default=0)
    assert rejoined["version"] == served >= 1
    assert any(
        e["event"] == "engine_caught_up" and e["engine"] == "engine1" and e["version"] == served
        for e in evs
        if lost["time"] < e["time"] <= rejoined["time"]
    )
    # ... and every sync reached each routed engine, both again after the rejoin.
    ledger = jsonl(run.run / "ledger.jsonl")
    assert [e["version"] for e in ledger] == list(range(1, len(ledger) + 1)) and len(ledger) >= steps - 1
    assert all(set(e["engine_versions"].values()) == {e["version"]} for e in ledger)
    assert len(ledger[-1]["engine_versions"]) == 2
    urls = [e["url"] for e in evs if e["event"] == "engine_ready" and e["engine"] == "engine1"]
    assert urls and all(u.startswith(f"http://{nodes.b}:") for u in urls), urls
    # After the end, `tether status` reads the records: stopped, B back up, every step trained.
    ended = run.status()
    assert (ended["source"], ended["state"], ended["step"]) == ("records", "stopped", steps - 1), ended
    assert {n["node"]: n["state"] for n in ended["nodes"]} == {"node-a": "up", "node-b": "up"}


def saves_under_way(ckpt: Path) -> list[Path]:
    """Checkpoints being written (or cut short): `iter_N.tmp`, never named by the tracker."""
    return sorted(ckpt.glob("iter_???????.tmp"))


@pytest.mark.parametrize("how", ["agent killed", "link down"])
def test_trainer_node_lost_stops_at_the_last_checkpoint(
    nodes: TwoNodes, ws: Workspace, tmp_path: Path, how: str
) -> None:
    """One trainer rank per node (a pipeline stage each, as in the split test); mid-run, node B's
    agent and everything under it SIGKILLed, or B's link taken down (its rank then blocks the
    step's collectives instead of breaking them). The head counts B lost, stops the trainer job
    on A too, and exits TRAINER_NODE_LOST_EXIT within a bound, naming node B and the last
    complete checkpoint; the records keep only the steps that checkpoint holds, and it validates."""
    ckpt = tmp_path / "ckpt"
    flags = list(SPLIT_TRAINER)
    flags += ["--update-weight-transport", "nccl", "--heartbeat-misses", "2"]
    flags += ["--save", str(ckpt), "--save-interval", "2"]
    with TwoNodeRun(nodes, ws, tmp_path, 100_000, *flags) as run:
        assert run.head is not None and run.agent is not None
        # Past step 2 (trained after step 1's checkpoint), and at best mid-save: a save is about
        # half of each two steps, but may also end between this check and the loss.
        run.wait_for("a checkpoint under way", lambda: run.steps_done() >= 3 and bool(saves_under_way(ckpt)))
        on_a = psutil.Process(run.head.pid).children(recursive=True)
        if how == "agent killed":
            on_b = run.node_b_processes()
            run.kill_agent()
            signal_all(on_b, signal.SIGKILL)  # the whole node: its ranks too, whatever their shims do
        else:
            run.link_b(up=False)
        killed = time.monotonic()
        try:
            code = run.head.wait(timeout=TOLERANCE + 40.0)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the head did not exit after node B was lost\n{run.output()}") from None
        finally:
            if how == "link down":
                run.link_b(up=True)  # B's agent, dropped, stops its rank; the test's exit stops it
        took = time.monotonic() - killed
    assert code == TRAINER_NODE_LOST_EXIT, run.output()
    assert took < TOLERANCE + 30.0, f"the head took {took:.0f} s to exit\n{run.output()}"
    for proc in on_a:  # torchrun and the rank on A, the engine, their shims: all stopped
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, proc
    # The tracker names a complete checkpoint; a save the loss cut short stays `.tmp`, newer.
    step = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    latest = ckpt / f"iter_{step:07d}"
    for done in ckpt.glob("iter_???????"):
        validate_checkpoint(done)
    assert max(int(d.name[5:]) for d in ckpt.glob("iter_???????")) == step
    assert all(int(t.name[5:12]) > step for t in saves_under_way(ckpt)), saves_under_way(ckpt)
    evs = run.events()
    (lost,) = [e for e in evs if e["event"] == "node_lost"]
    assert lost["node"] == "node-b" and lost["processes"] == ["trainer-node1"], lost
    failed = evs[-1]
    assert failed["event"] == "failed" and failed["node"] == "node-b", failed
    assert (failed["checkpoint"], failed["checkpoint_step"]) == (str(latest), step), failed
    final = (tmp_path / "head.out").read_text().splitlines()[-1]
    assert final.startswith("tether run: node 'node-b'") and str(latest) in final, final
    # The records keep the steps the checkpoint holds; those after it run again on resume.
    assert model_steps(jsonl(run.run / "samples.jsonl")).steps == list(range(step + 1))


@dataclass(frozen=True)
class ThirdNode:
    """Node C: a namespace of its own, joined to the root namespace (node A) by a veth pair."""

    namespace: str
    a: str  # the root namespace's end of C's pair
    c: str  # node C's address
    name: str = "node-c"


@pytest.fixture(scope="module")
def node_c(nodes: TwoNodes) -> Iterator[ThirdNode]:
    """C reaches the head at A's address on B's pair through a route via its own pair's root
    end (the root namespace delivers to any of its own addresses). B and C reach each other
    through the root namespace too, as nodes of one cluster do (a weight-update group's ranks
    connect to one another): forwarding is turned on for the two root ends only, which this test
    made and removes."""
    tag = f"{os.getpid() % 10**7}"
    net = _free_subnet()
    first, second = list(net.hosts())
    third = ThirdNode(f"tether-c-{tag}", str(first), str(second))
    if_a, if_c = f"tca{tag}", f"tcc{tag}"
    made_namespace = made_link = False
    try:
        steps = [
            ("netns", "add", third.namespace),
            ("link", "add", if_a, "type", "veth", "peer", "name", if_c, "netns", third.namespace),
            ("addr", "add", f"{third.a}/{net.prefixlen}", "dev", if_a),
            ("link", "set", if_a, "up"),
            ("-n", third.namespace, "addr", "add", f"{third.c}/{net.prefixlen}", "dev", if_c),
            ("-n", third.namespace, "link", "set", if_c, "up"),
            ("-n", third.namespace, "link", "set", "lo", "up"),
            ("-n", third.namespace, "route", "add", f"{nodes.a}/32", "via", third.a),
            ("-n", third.namespace, "route", "add", f"{nodes.b}/32", "via", third.a),
            ("-n", nodes.namespace, "route", "add", f"{third.c}/32", "via", nodes.a),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot make node C's namespace: `ip {' '.join(step)}`: {done.stderr.strip()}")
            made_namespace = True
            made_link = made_link or step[0] == "link"
        for root_end in (nodes.if_a, if_a):
            Path(f"/proc/sys/net/ipv4/conf/{root_end}/forwarding").write_text("1\n")
        yield third
    finally:
        _ip("-n", nodes.namespace, "route", "del", f"{third.c}/32")
        with contextlib.suppress(OSError):  # B's end stays: its own tests run without forwarding
            Path(f"/proc/sys/net/ipv4/conf/{nodes.if_a}/forwarding").write_text("0\n")
        if made_link:
            _ip("link", "del", if_a)
        if made_namespace:
            _ip("netns", "del", third.namespace)


def start_joining_agent(run: TwoNodeRun, third: ThirdNode, *flags: str) -> subprocess.Popen[bytes]:
    """`tether agent --join` for node C, inside C's namespace."""
    head = (run.run / "head_address").read_text().strip()
    agent = [sys.executable, "-m", "tether", "agent", "--head", head, "--node-name", third.name, "--join"]
    with open(run.root / "agent-c.out", "ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", third.namespace, *agent, "--run-dir", str(run.run), *flags],
            env=run.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def syncs_to(run: TwoNodeRun, engine: str) -> int:
    """Weight syncs that reached `engine`."""
    path = run.run / "ledger.jsonl"
    return sum(engine in e["engine_versions"] for e in jsonl(path)) if path.exists() else 0


@pytest.mark.parametrize("transport", ["disk", "nccl-pp2"])
def test_node_joins_mid_run_and_is_drained(
    nodes: TwoNodes, node_c: ThirdNode, ws: Workspace, tmp_path: Path, transport: str
) -> None:
    """A third node joins the running run (`tether agent --join`): the head places an engine on
    it, starts it there, catches it up to the served weights and routes to it; it serves, then
    `tether drain` takes it out (its requests finish or are requeued), its agent exits 0, and
    training goes on. From the records: every step trained once, no sample twice, the joined
    engine caught up to the version then served and synced after, capacity_added and
    capacity_drained recorded, `tether status` showing node C joined and drained. With the
    distributed transport (gloo on CPU) under PP=2, each stage's source builds its update group
    afresh for the engines of the moment: with node C's engine, then without it."""
    if transport == "disk":
        flags = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "weights")]
    else:
        flags = ["--update-weight-transport", "nccl", "--pipeline-model-parallel-size", "2"]
    with TwoNodeRun(nodes, ws, tmp_path, 100_000, *flags) as run:
        run.wait_for("the first step", lambda: run.steps_done() >= 1)
        joining = start_joining_agent(run, node_c, "--devices", "0")
        try:
            run.wait_for("node C's engine added", lambda: run.seen("capacity_added"))
            (added,) = [e for e in run.events() if e["event"] == "capacity_added"]
            (url,) = added["urls"]
            assert url.startswith(f"http://{node_c.c}:"), added
            run.wait_for("two syncs to node C's engine", lambda: syncs_to(run, "engine1") >= 2)
            live = run.status()
            nodes_now = {n["node"]: (n["state"], n["joined"]) for n in live["nodes"]}
            assert nodes_now["node-c"] == ("up", True), live
            assert {e["engine"]: e["state"] for e in live["engines"]}["engine1"] == "serving", live
            drained = subprocess.run(
                [sys.executable, "-m", "tether", "drain", str(run.run), node_c.name],
                env=run.env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert drained.returncode == 0, drained.stderr + run.output()
            assert json.loads(drained.stdout)["engines"] == ["engine1"], drained.stdout
            assert joining.wait(timeout=60) == 0, (run.root / "agent-c.out").read_text()
            at_drain = run.steps_done()
            run.wait_for("two steps after the drain", lambda: run.steps_done() >= at_drain + 2)
            run.stop_run()
        finally:
            if joining.poll() is None:
                joining.kill()
                joining.wait()
    evs = run.events()
    kinds = [e["event"] for e in evs]
    assert kinds[-1] == "stopped" and "failed" not in kinds and "join_failed" not in kinds
    # Every step trained once, no sample twice, every trained group whole.
    records = jsonl(run.run / "samples.jsonl")
    assert [r["step"] for r in records] == list(range(len(records)))
    indices = [s[0] for r in records for s in r["samples"]]
    assert len(indices) == len(set(indices)), "a sample was trained twice"
    # Joined at the version then served, caught up to it before its first request.
    (added,) = [e for e in evs if e["event"] == "capacity_added"]
    (drain,) = [e for e in evs if e["event"] == "capacity_drained"]
    assert (added["node"], added["engines"], drain["node"], drain["engines"]) == (
        "node-c",
        ["engine1"],
        "node-c",
        ["engine1"],
    )
    syncs = [e for e in evs if e["event"] == "weight_sync"]
    ledger = jsonl(run.run / "ledger.jsonl")
    if transport == "disk":  # loaded the served version's files
        (caught_up,) = [e for e in evs if e["event"] == "engine_caught_up" and e["engine"] == "engine1"]
        served = max((e["version"] for e in syncs if e["time"] < caught_up["time"]), default=0)
        assert caught_up["version"] == served >= 1 and caught_up["time"] <= added["time"], (caught_up, served)
    else:  # a full sync as a new version, over update groups built afresh with it
        first = min((e for e in ledger if "engine1" in e["engine_versions"]), key=lambda e: e["version"])
        assert first["version"] == added["version"] and first["finished_at"] <= added["time"], first
    assert added["version"] == max(e["version"] for e in syncs if e["time"] < added["time"]), added
    assert drain["requests"]["engine1"] > 0, drain  # it generated while it was in the run
    # Every sync while it was in reached it at that version; none after the drain.
    assert [e["version"] for e in ledger] == list(range(1, len(ledger) + 1))
    assert all(set(e["engine_versions"].values()) == {e["version"]} for e in ledger)
    during = [e for e in ledger if added["time"] < e["finished_at"] < drain["time"]]
    assert len(during) >= 2 and all("engine1" in e["engine_versions"] for e in during), during
    after = [e for e in ledger if e["finished_at"] > drain["time"]]
    assert len(after) >= 1 and not any("engine1" in e["engine_versions"] for e in after), after
    node_events = [(e["event"], e["node"]) for e in evs if e["event"] in ("node_joined", "node_drained")]
    assert node_events == [("node_joined", "node-c"), ("node_drained", "node-c")], node_events
    # After the end, `tether status` reads the records: C joined and drained, its engine too.
    ended = run.status()
    assert {n["node"]: n["state"] for n in ended["nodes"]}["node-c"] == "drained", ended
    assert {e["engine"]: e["state"] for e in ended["engines"]}["engine1"] == "drained", ended

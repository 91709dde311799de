"""The supervisor: the head's owner of every process of a run, on every node.

    async with Supervisor(run_dir, secret, on_exit=report) as sup:
        engine = await sup.start(ProcessSpec(name="engine0", argv=[...], env=placement_env),
                                 ready=engine_answers, ready_timeout=300)
        ref, address = await sup.start_announced(ProcessSpec(name="ref", argv=[...], node="node1"),
                                                 setup={"path": p})
        scorer = await sup.connect(ref, address)   # an RPC handle the supervisor keeps informed
        sup.monitor(ref, scorer.ping, name="ref")  # heartbeats, reported like an exit
        await scorer.score(batch)
        await sup.watch()          # raises ActorDied / HeartbeatLost at the first failure

Processes start through the node agent of their node: an in-process `NodeAgent` for the
node named `local` (this machine), and agents that registered with `tether agent --head
<sup.address>` for the others. An agent launches a zygote (runtime/process/zygote.py) at the first
start of a spec that sets `zygote`: such a Python process is forked from it, a few
milliseconds instead of an interpreter start and the runtime's imports; any other is spawned.
Failures the owner did not ask for reach it three ways:
`on_exit(ExitInfo)` / `on_unresponsive(HeartbeatLost)` callbacks, `ManagedProcess.wait()`,
and `watch()`, which raises the first failure (run it in the run loop's TaskGroup).

A process started with `start_announced` talks to the head's control RPC at `sup.address`
(with the run's secret, `TETHER_SECRET`): `process_setup(name)` returns the setup data its
starter registered, as {"data": ..., "interval", "timeout", "misses"} (the heartbeat settings,
for watching the head in turn), and `process_ready(name, address)` says it is ready and where
it serves; `start_announced` returns that address.

Leaving the block stops everything: SIGTERM to each process group, a grace period, SIGKILL;
remote agents are told to shut down. Processes that can be asked to exit (trainer ranks serve
a `shutdown` call) are better stopped first with `stop_gracefully`, which falls back to the
same signals only when they have not exited in time. If the head dies without that (SIGKILL),
the shims' PR_SET_PDEATHSIG and the heartbeats of the agents (and of processes that watch
the head) end every child.

Every exit is recorded in the run directory's events.jsonl as a `process_exit` event: name,
node, pid, exit code or signal, whether the owner had stopped it (`expected`) and how
(`stopped_by`: "request" when it was asked and exited by itself, "signal" when it was sent
SIGTERM/SIGKILL, null when it ended on its own).

A node whose agent stops answering heartbeats is lost: its processes are reported exited
(reason "node agent lost"), a `node_lost` event is recorded, and starting anything there
raises NodeLost until an agent registers under the node's name again (`node_joined`,
`rejoined: true`); `wait_for_node` waits for that. A registration under a registered node's
name is refused while the registered agent still answers, and replaces it (lost) otherwise:
an agent restarted at once after a SIGKILL need not wait for the heartbeats to run out.

An agent that was lost but still runs (its processes were SIGSTOPped, or its link was down,
past the tolerance) learns it from its own heartbeat, `agent_heartbeat(node, token)`, which
answers False once its registration is gone; or it gives the head up itself. Either way it
stops its processes and registers again, passing the token of its last registration
(`previous`): a registration that names the registered agent's token replaces it at once (it
is that agent, back, with its processes stopped). An exit report from a lost agent's process
(its pid is not that of the process now running under the name) is ignored.

Capacity that comes and goes (`capacity`, set by the run): an agent registering with `join`
(`tether agent --join`) for a node the run does not know yet is checked by
`capacity.check_join` before it is registered (a refusal reaches the agent as the error of its
registration), recorded as `node_joined` with `joined: true`, and handed to `capacity.join`,
which the supervisor's task group runs (its failure is recorded as `join_failed` and the node
let go). `drain(node)` (the control call `drain_node`, from `tether drain`) runs
`capacity.drain` (which stops the node's processes) and then lets the node go: its heartbeats
stop, the agent is told to exit (0), and the node is `drained`, not lost (`node_drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from tether.runtime.errors import ActorDied, HeartbeatLost, NodeLost
from tether.runtime.process.agent import NodeAgent
from tether.runtime.process.spec import ExitInfo, ProcessSpec, log_path, read_log_tail
from tether.runtime.rpc.actors import ActorHandle, RpcServer, connect
from tether.runtime.rpc.liveness import LivenessMonitor

log = logging.getLogger(__name__)

LOCAL = "local"
NODE_LOST = "node agent lost"  # how the exit reason of a lost node's process begins
READY_POLL_MAX = 0.1  # seconds between readiness checks of a starting process, at most
# ... where a check is a few file lookups (a trainer job's rank address files): 10 ms late at
# most, where every run's first step waits on the last check.
CHEAP_READY_POLL_MAX = 0.01


class Heartbeat(msgspec.Struct, frozen=True):
    """Liveness settings for agents and monitored processes (seconds)."""

    interval: float = 1.0
    timeout: float = 3.0
    first_wait: float = 1.0
    misses: int = 3  # consecutive missed heartbeats before a peer counts as lost

    @property
    def tolerance(self) -> float:
        """Seconds, at most, from a peer's last answer until it counts as lost."""
        return self.misses * (self.interval + self.timeout)


def exit_error(info: ExitInfo) -> ActorDied:
    return ActorDied(
        info.name, returncode=info.returncode, signal=info.signal, log_tail=info.log_tail, reason=info.reason
    )


class Capacity(Protocol):
    """What the run does when a node joins or is drained (see the module docstring)."""

    def check_join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        """Raise (ValueError, ConfigError) to refuse the node before it is registered."""

    async def join(self, node: str, address: str, inventory: dict[str, Any]) -> None: ...

    async def drain(self, node: str) -> dict[str, Any]:
        """Stop the node's work; returns what to record in `node_drained`."""


class _Agent(Protocol):
    async def start_process(self, spec: ProcessSpec) -> int: ...

    async def stop_process(self, name: str, grace: float | None = None) -> ExitInfo: ...


class _RemoteAgent:
    """The head's side of a registered node agent."""

    def __init__(self, node: str, handle: ActorHandle, inventory: dict[str, Any], token: int) -> None:
        self.node = node
        self.handle = handle
        self.inventory = inventory
        self.token = token  # this registration's, which the agent's heartbeats name
        self.monitor: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()

    async def start_process(self, spec: ProcessSpec) -> int:
        return int(await self.handle.call("start_process", spec, timeout=60.0))

    async def stop_process(self, name: str, grace: float | None = None) -> ExitInfo:
        budget = 60.0 if grace is None else grace + 30.0
        return await self.handle.call("stop_process", name, grace, timeout=budget, result_type=ExitInfo)  # type: ignore[no-any-return]


@dataclass
class ManagedProcess:
    """A process the supervisor started; `wait()` returns how it ended."""

    name: str
    node: str
    spec: ProcessSpec
    pid: int = 0
    handle: ActorHandle | None = None
    stopping: bool = False
    exit: asyncio.Future[ExitInfo] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    monitor: asyncio.Task[None] | None = None
    restartable: bool = False
    """The owner watches this process (`wait()`) and replaces it when it dies: its exit does not end the run."""
    stopped_by: str | None = None
    """How the owner ended it: "request" (asked, see `Supervisor.stop_gracefully`) or "signal"."""

    async def wait(self) -> ExitInfo:
        return await asyncio.shield(self.exit)

    @property
    def running(self) -> bool:
        return not self.exit.done()


class _HeadService:
    """The head's RPC interface, used by node agents and by processes started with
    `Supervisor.start_announced`."""

    def __init__(self, sup: Supervisor) -> None:
        self._sup = sup

    async def agent_setup(self) -> dict[str, Any]:
        hb = self._sup.heartbeat
        return {
            "run_dir": str(self._sup.run_dir),
            "interval": hb.interval,
            "timeout": hb.timeout,
            "misses": hb.misses,
        }

    async def register_agent(
        self,
        node: str,
        address: str,
        inventory: dict[str, Any],
        previous: int | None = None,
        join: bool = False,
    ) -> int:
        """Register `node`'s agent; returns the registration's token. `previous`: the token of
        this agent's last registration, when it registers again after it was dropped. `join`:
        a node new to the run, whose capacity the run adds (`tether agent --join`)."""
        return await self._sup._register_agent(node, address, inventory, previous, join=join)

    async def drain_node(self, node: str) -> dict[str, Any]:
        """Drain `node` (`tether drain`): its work ends, its agent exits; returns the record."""
        return await self._sup.drain(node)

    async def agent_heartbeat(self, node: str, token: int) -> bool:
        """The agent's heartbeat: False once registration `token` of `node` is gone (the
        agent was lost), which tells it to stop its processes and register again."""
        agent = self._sup._agents.get(node)
        return agent is not None and agent.token == token

    async def process_exited(self, info: ExitInfo) -> None:
        self._sup._on_process_exit(info)

    async def process_setup(self, name: str) -> dict[str, Any]:
        starting = self._sup._announcing.get(name)
        if starting is None:
            raise KeyError(f"no process named {name!r} is starting")
        hb = self._sup.heartbeat
        return {"data": starting.setup, "interval": hb.interval, "timeout": hb.timeout, "misses": hb.misses}

    async def process_ready(self, name: str, address: str) -> None:
        starting = self._sup._announcing.get(name)
        if starting is None:
            raise KeyError(f"no process named {name!r} is starting")
        if not starting.ready.done():
            starting.ready.set_result(address)

    async def status(self) -> dict[str, Any]:
        """The run as the head sees it now (`tether status`): its nodes, and what the run's
        status provider adds (engines, trainer ranks, step)."""
        found: dict[str, Any] = {"nodes": self._sup.node_states()}
        if self._sup.status_provider is not None:
            found.update(await self._sup.status_provider())
        return found


@dataclass
class _Announcing:
    """A process `start_announced` is starting: its setup data, and the address it announces."""

    setup: dict[str, Any]
    ready: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Supervisor:
    """Starts and owns processes on every node; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        secret: bytes,
        *,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        grace: float = 10.0,
        heartbeat: Heartbeat | None = None,
        on_exit: Callable[[ExitInfo], None] | None = None,
        on_unresponsive: Callable[[HeartbeatLost], None] | None = None,
        inventory: Callable[[], dict[str, Any]] | None = None,
        zygote: bool = True,
    ) -> None:
        """`zygote`: fork this machine's processes whose spec sets `zygote` from a zygote
        (launched at the first such start); without it they are spawned, as every other
        process is."""
        self.run_dir = Path(run_dir)
        self.grace = grace
        self.heartbeat = heartbeat or Heartbeat()
        self.bind_host = bind_host
        self._secret = secret
        self._port = port
        self._on_exit_cb = on_exit
        self._on_unresponsive_cb = on_unresponsive
        self._inventory = inventory
        self._zygote = zygote
        self._procs: dict[str, ManagedProcess] = {}
        self._agents: dict[str, _RemoteAgent] = {}
        self._lost: dict[str, str] = {}  # node → why its agent was lost (until one registers again)
        self._tokens = itertools.count(1)  # agent registrations
        self._agent_changed = asyncio.Event()
        self._joined: set[str] = set()  # nodes that joined the run (`tether agent --join`)
        self._drained: set[str] = set()  # nodes let go by `drain`
        self.capacity: Capacity | None = None
        """What joining and draining nodes do to the run (the run sets it; None: refused)."""
        self.status_provider: Callable[[], Awaitable[dict[str, Any]]] | None = None
        """What the `status` control call adds to the nodes (the run sets it)."""
        self._failures: asyncio.Queue[BaseException] = asyncio.Queue()
        self._announcing: dict[str, _Announcing] = {}
        self._stack = contextlib.AsyncExitStack()
        self._tg: asyncio.TaskGroup | None = None
        self._server: RpcServer | None = None
        self._local: NodeAgent | None = None

    @property
    def address(self) -> str:
        """The control address agents connect to (`tether agent --head <address>`)."""
        if self._server is None:
            raise RuntimeError("the supervisor is not running")
        return self._server.address

    @property
    def nodes(self) -> dict[str, dict[str, Any]]:
        """Node name → inventory, for this machine and every registered agent."""
        found = {LOCAL: self._local_inventory()}
        found.update({name: agent.inventory for name, agent in self._agents.items()})
        return found

    def _local_inventory(self) -> dict[str, Any]:
        if self._inventory is not None:
            return self._inventory()
        from tether.runtime.process.agent import default_inventory

        return default_inventory(LOCAL, self.bind_host)

    async def __aenter__(self) -> Supervisor:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
            self._server = await self._stack.enter_async_context(
                RpcServer(
                    _HeadService(self), f"tcp://{self.bind_host}:{self._port}", self._secret, name="head"
                )
            )
            self._local = await self._stack.enter_async_context(
                NodeAgent(
                    LOCAL,
                    self.run_dir,
                    self._secret,
                    on_exit=self._local_exit,
                    inventory=self._inventory,
                    grace=self.grace,
                    bind_host=self.bind_host,
                    zygote=self._zygote,
                )
            )
            self._stack.push_async_callback(self._shutdown)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._stack.aclose()

    async def _shutdown(self) -> None:
        """Stop every process, then the agents; runs before the server and local agent close."""
        running = [p for p in self._procs.values() if p.running]
        async with asyncio.TaskGroup() as tg:
            for proc in running:
                tg.create_task(self._stop_quietly(proc.name))
        for agent in self._agents.values():
            with contextlib.suppress(Exception):
                await agent.handle.call("shutdown", timeout=5.0)
            if agent.monitor is not None:
                agent.monitor.cancel()
            await agent.handle.close()
        for proc in self._procs.values():
            if proc.monitor is not None:
                proc.monitor.cancel()
            if proc.handle is not None:
                await proc.handle.close()

    async def _stop_quietly(self, name: str) -> None:
        try:
            await self.stop(name)
        except Exception:
            log.exception("stopping %r failed", name)

    # -- agents ---------------------------------------------------------------------------
    async def _register_agent(
        self,
        node: str,
        address: str,
        inventory: dict[str, Any],
        previous: int | None = None,
        *,
        join: bool = False,
    ) -> int:
        if node == LOCAL:
            raise ValueError(
                f"node name {node!r} is reserved for the head's own node; give the agent another --node-name"
            )
        # A joined node registering again (after it was lost) is back, not joining anew.
        joining = join and node not in self._joined
        if joining:
            self._check_join(node, address, inventory)
        old = self._agents.get(node)
        if old is not None and previous is not None and previous == old.token:
            # The registered agent itself, back after giving the head up: its processes are stopped.
            self._lose_agent(old, "its agent lost the head and registered again")
            await old.handle.close()
        elif old is not None:
            try:
                await old.handle.ping(timeout=self.heartbeat.timeout)
            except Exception as exc:  # the registered agent is gone: this one replaces it
                self._lose_agent(old, f"replaced by a new agent from {address} ({type(exc).__name__})")
                await old.handle.close()
            else:
                raise ValueError(f"node name {node!r} is already taken; give the agent another --node-name")
        assert self._tg is not None
        handle = await connect(address, self._secret, name=f"agent:{node}", timeout=30.0)
        agent = _RemoteAgent(node, handle, inventory, next(self._tokens))
        self._agents[node] = agent
        rejoined = self._lost.pop(node, None) is not None
        if rejoined:
            self._record({"event": "node_joined", "node": node, "address": address, "rejoined": True})
        if joining:
            assert self.capacity is not None  # _check_join refuses a join without it
            self._joined.add(node)
            self._drained.discard(node)
            self._record({"event": "node_joined", "node": node, "address": address, "joined": True})
            self._tg.create_task(self._join(node, address, inventory), name=f"join:{node}")
        hb = self.heartbeat
        monitor = LivenessMonitor(
            handle.ping,
            interval=hb.interval,
            timeout=hb.timeout,
            first_wait=hb.first_wait,
            misses=hb.misses,
            name=f"agent {node!r}",
        )
        agent.monitor = self._tg.create_task(self._watch_agent(agent, monitor))
        self._agent_changed.set()
        log.info("node %r registered from %s", node, address)
        return agent.token

    def _check_join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        if self.capacity is None:
            raise ValueError(f"node {node!r} cannot join: this run adds no capacity while it runs")
        if node in self._agents or node in self._lost:
            raise ValueError(
                f"node {node!r} is already a node of this run; start its agent without --join "
                "(or give the joining node another --node-name)"
            )
        self.capacity.check_join(node, address, inventory)

    async def _join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        """The run adds `node`'s capacity; a failure lets the node go, the run goes on."""
        assert self.capacity is not None
        try:
            await self.capacity.join(node, address, inventory)
        except Exception as exc:
            log.exception("node %r could not join", node)
            self._record({"event": "join_failed", "node": node, "error": f"{type(exc).__name__}: {exc}"})
            agent = self._agents.get(node)
            if agent is not None:
                await self._release(agent)

    async def drain(self, node: str) -> dict[str, Any]:
        """Drain `node`: the run stops its work there (`capacity.drain`), then its agent is let
        go and exits; returns the `node_drained` record."""
        agent = self._agents.get(node)
        if node == LOCAL or agent is None:
            known = ", ".join(self._agents) or "none"
            raise ValueError(
                f"no node {node!r} to drain (nodes with an agent: {known}; the head's own cannot be)"
            )
        if self.capacity is None:
            raise ValueError(f"node {node!r} cannot be drained: this run cannot change its capacity")
        busy = [p.name for p in self._procs.values() if p.node == node and p.running and not p.restartable]
        if busy:
            raise ValueError(
                f"node {node!r} runs {busy}, which the run cannot go on without; only engine nodes drain"
            )
        record = {"event": "node_drained", "node": node, **await self.capacity.drain(node)}
        # Recorded once its work is gone, before the agent is let go: the drain is done then.
        self._record(record)
        if self._agents.get(node) is agent:
            self._drained.add(node)
            await self._release(agent)
        return record

    async def _release(self, agent: _RemoteAgent) -> None:
        """Let `agent`'s node go, not lost: no more heartbeats to it, the agent told to exit."""
        # In this order: a heartbeat missed as it exits must not count it lost, and its own
        # heartbeat must not hear "not registered" (which makes an agent register again) before
        # it has been told to exit.
        if agent.monitor is not None and agent.monitor is not asyncio.current_task():
            agent.monitor.cancel()
        with contextlib.suppress(Exception):  # one that exits at once may not answer
            await agent.handle.call("shutdown", timeout=5.0)
        self._agents.pop(agent.node, None)
        self._joined.discard(agent.node)
        await agent.handle.close()
        self._agent_changed.set()

    async def wait_for_agents(self, nodes: list[str], timeout: float | None) -> None:  # noqa: ASYNC109  # the API takes per-call timeouts
        """Wait until every node in `nodes` has a registered agent (`timeout` None: for ever)."""
        async with asyncio.timeout(timeout):
            while any(n != LOCAL and n not in self._agents for n in nodes):
                self._agent_changed.clear()
                await self._agent_changed.wait()

    async def wait_for_node(self, node: str) -> None:
        """Return once `node` has a registered agent (at once for this machine's node)."""
        await self.wait_for_agents([node], None)

    def node_states(self) -> dict[str, dict[str, Any]]:
        """Node name → {"state": "up" | "lost" | "drained", "reason"} for this machine, every
        registered agent, every node lost since and every node drained; `"joined": True` for a
        node that joined the run while it ran."""
        states: dict[str, dict[str, Any]] = {LOCAL: {"state": "up", "reason": ""}}
        states.update({node: {"state": "up", "reason": ""} for node in self._agents})
        states.update({node: {"state": "lost", "reason": why} for node, why in self._lost.items()})
        states.update({node: {"state": "drained", "reason": ""} for node in self._drained})
        for node in self._joined:
            states[node]["joined"] = True
        return states

    async def node_loss(self, node: str) -> str | None:
        """Why `node` is lost, or None while its agent answers, asked now: one ping (a heartbeat
        timeout at most), and a node that does not answer gets the heartbeats' verdict within
        their tolerance. For an owner whose call just failed in a way a lost node would explain."""
        agent = self._agents.get(node)
        if agent is not None:
            try:
                await agent.handle.ping(timeout=self.heartbeat.timeout)
            except Exception:  # not an answer: the heartbeats decide
                await self._verdict(agent)
        return self._lost.get(node)

    async def _watch_agent(self, agent: _RemoteAgent, monitor: LivenessMonitor) -> None:
        try:
            await monitor.run()
        except HeartbeatLost as lost:
            if self._agents.get(agent.node) is agent:
                self._lose_agent(agent, lost.reason)
            await agent.handle.close()

    def _lose_agent(self, agent: _RemoteAgent, reason: str) -> None:
        """`agent`'s node is lost: report its processes exited, then fail the calls still waiting
        on it (whoever waits sees the exits first)."""
        log.error("node %r lost (%s); its processes are lost", agent.node, reason)
        self._agents.pop(agent.node, None)
        self._lost[agent.node] = reason
        agent.lost.set()
        if agent.monitor is not None and agent.monitor is not asyncio.current_task():
            agent.monitor.cancel()
        names = [p.name for p in self._procs.values() if p.node == agent.node and p.running]
        self._record({"event": "node_lost", "node": agent.node, "reason": reason, "processes": names})
        for name in names:
            proc = self._procs[name]
            self._on_process_exit(
                ExitInfo(name=name, node=agent.node, pid=proc.pid, reason=f"{NODE_LOST}: {reason}")
            )
        self._agent_changed.set()

    async def _verdict(self, agent: _RemoteAgent) -> None:
        """Wait, within the heartbeat tolerance, for `agent` to count as lost (a call to it just
        failed on a lost connection); return either way."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.heartbeat.tolerance + self.heartbeat.first_wait):
                await agent.lost.wait()

    def _agent(self, node: str) -> _Agent:
        if node == LOCAL:
            assert self._local is not None
            return self._local
        if node in self._lost:
            raise NodeLost(node, self._lost[node])
        agent = self._agents.get(node)
        if agent is None:
            known = ", ".join([LOCAL, *self._agents]) or LOCAL
            raise ValueError(f"node={node!r}: no agent registered for it (known: {known})")
        return agent

    # -- processes ------------------------------------------------------------------------
    async def _local_exit(self, info: ExitInfo) -> None:
        self._on_process_exit(info)

    def _on_process_exit(self, info: ExitInfo) -> None:
        proc = self._procs.get(info.name)
        if proc is None or not proc.running:
            return
        if info.pid and proc.pid and info.pid != proc.pid:
            return  # a late report from a lost agent, about the process its name had before
        proc.exit.set_result(info)
        self._record_exit(proc, info)
        if proc.monitor is not None:
            proc.monitor.cancel()
        if proc.handle is not None:
            proc.handle.mark_dead(exit_error(info))
        if proc.stopping:
            return
        if proc.restartable:
            log.warning(
                "process %r on node %r ended: %s; its owner replaces it",
                info.name,
                info.node,
                exit_error(info),
            )
            return
        log.error("process %r on node %r ended unexpectedly: %s", info.name, info.node, exit_error(info))
        self._failures.put_nowait(exit_error(info))
        if self._on_exit_cb is not None:
            self._on_exit_cb(info)

    def _record_exit(self, proc: ManagedProcess, info: ExitInfo) -> None:
        """One `process_exit` line in events.jsonl."""
        record = {
            "event": "process_exit",
            "name": info.name,
            "node": info.node,
            "pid": info.pid,
            "returncode": info.returncode,
            "signal": info.signal,
            "expected": proc.stopping,
            "stopped_by": proc.stopped_by,
            "reason": info.reason,
        }
        self._record(record)

    def _record(self, record: dict[str, Any]) -> None:
        """One line in events.jsonl (one write of a whole line, as the head's)."""
        try:
            with open(self.run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        except OSError as exc:  # a record is not worth failing the run's bookkeeping over
            log.warning("could not record %s: %s", record.get("event"), exc)

    async def start(
        self,
        spec: ProcessSpec,
        ready: Callable[[], Awaitable[bool]] | None = None,
        ready_timeout: float = 120.0,
        *,
        restartable: bool = False,
        ready_poll_max: float = READY_POLL_MAX,
    ) -> ManagedProcess:
        """Start `spec` on its node; return once `ready()` is true (when given).

        Raises ActorDied, with the log tail, if the process exits first or is not ready in time
        (it is stopped then). With `restartable` a later exit is left to the owner (who awaits
        `wait()` and replaces the process) instead of ending the run through `watch()`.
        `ready()` is asked again after 10 ms, then twice as long each time, `ready_poll_max` at
        most (`CHEAP_READY_POLL_MAX` where a check costs no request).
        """
        return await self._start(spec, ready, None, ready_timeout, restartable, ready_poll_max)

    async def _start(
        self,
        spec: ProcessSpec,
        ready: Callable[[], Awaitable[bool]] | None,
        ready_future: asyncio.Future[Any] | None,
        ready_timeout: float,
        restartable: bool = False,
        ready_poll_max: float = READY_POLL_MAX,
    ) -> ManagedProcess:
        spec.validate()
        existing = self._procs.get(spec.name)
        if existing is not None and existing.running:
            raise ValueError(f"a process named {spec.name!r} is already running")
        agent = self._agent(spec.node)
        proc = ManagedProcess(spec.name, spec.node, spec, restartable=restartable)
        self._procs[spec.name] = proc
        try:
            proc.pid = await agent.start_process(spec)
        except BaseException as exc:
            # Not started (or cancelled on the way, e.g. a stop signal during start-up): nothing
            # of ours to stop, and no one may wait for its exit forever.
            if self._procs.get(spec.name) is proc:
                del self._procs[spec.name]
            if not proc.exit.done():
                proc.exit.set_result(ExitInfo(name=spec.name, node=spec.node, pid=0, reason="never started"))
            if isinstance(exc, ActorDied) and isinstance(agent, _RemoteAgent):
                await self._verdict(agent)  # a dead connection: the heartbeats say whether the node is
            if isinstance(exc, Exception) and spec.node in self._lost:
                raise NodeLost(spec.node, self._lost[spec.node]) from exc
            raise
        try:
            async with asyncio.timeout(ready_timeout):
                if ready_future is not None:
                    await asyncio.wait((ready_future, proc.exit), return_when=asyncio.FIRST_COMPLETED)
                elif ready is not None:
                    delay = min(0.01, ready_poll_max)
                    while proc.running and not await ready():
                        await asyncio.wait((proc.exit,), timeout=delay)
                        # At most `ready_poll_max` late: a check may cost a local HTTP request,
                        # and every run's first step waits on the last one.
                        delay = min(delay * 2, ready_poll_max)
        except TimeoutError:
            info = await self.stop(spec.name)
            raise ActorDied(
                spec.name,
                returncode=info.returncode,
                signal=info.signal,
                log_tail=info.log_tail,
                reason=f"not ready within {ready_timeout:g} s",
            ) from None
        if proc.exit.done():
            if spec.node in self._lost:  # not the process's fault: its node went while it started
                raise NodeLost(spec.node, self._lost[spec.node]) from exit_error(proc.exit.result())
            raise exit_error(proc.exit.result())
        return proc

    async def stop(self, name: str, grace: float | None = None) -> ExitInfo:
        """Stop `name` (SIGTERM, `grace` seconds, SIGKILL) and return how it ended."""
        proc = self._procs.get(name)
        if proc is None:
            raise KeyError(f"no process named {name!r}")
        if proc.running:
            proc.stopping = True
            proc.stopped_by = "signal"
            if proc.monitor is not None:
                proc.monitor.cancel()
            try:
                await self._agent(proc.node).stop_process(name, grace)
            except (KeyError, ValueError) as exc:
                # Already reaped on the agent, or its node is gone: its exit is (being) reported.
                log.info("stop %r: %s", name, exc)
            except Exception as exc:
                self._on_process_exit(
                    ExitInfo(name=name, node=proc.node, pid=proc.pid, reason=f"stop failed: {exc}")
                )
        if proc.handle is not None:
            await proc.handle.close()
        return await proc.wait()

    async def stop_gracefully(
        self,
        names: Sequence[str],
        ask: Callable[[], Awaitable[object]],
        *,
        timeout: float,  # noqa: ASYNC109  # the API takes per-call timeouts
        grace: float | None = None,
    ) -> list[ExitInfo]:
        """Stop `names` by asking them first; return how each ended, in order.

        `ask()` tells the processes to exit by themselves (an RPC they serve, say); then up to
        `timeout` seconds (asking included) are allowed for all of them to end. Whatever still
        runs after that is stopped as `stop` does: SIGTERM, `grace` seconds, SIGKILL. Their
        exits are expected, never a failure of the run. An error of `ask()` is logged, not
        raised: a process that exits at once may drop the connection before it answers.
        """
        procs = [self._procs[name] for name in names]
        asked = [p for p in procs if p.running]
        for proc in asked:
            proc.stopping = True
            proc.stopped_by = "request"
            if proc.monitor is not None:
                proc.monitor.cancel()
        if asked:
            try:
                async with asyncio.timeout(timeout):
                    try:
                        await ask()
                    except Exception as exc:
                        log.info("asking %s to exit: %s", ", ".join(p.name for p in asked), exc)
                    await asyncio.wait([p.exit for p in asked])
            except TimeoutError:
                late = ", ".join(p.name for p in asked if p.running)
                log.warning(
                    "%s did not exit within %g s of being asked to; stopping by signal", late, timeout
                )
        async with asyncio.TaskGroup() as tg:
            stops = [tg.create_task(self.stop(p.name, grace)) for p in procs]
        return [t.result() for t in stops]

    def process(self, name: str) -> ManagedProcess:
        return self._procs[name]

    async def watch(self) -> None:
        """Raise the first failure the owner did not ask for (ActorDied or HeartbeatLost)."""
        raise await self._failures.get()

    async def start_announced(
        self,
        spec: ProcessSpec,
        setup: dict[str, Any] | None = None,
        ready_timeout: float = 120.0,
        *,
        restartable: bool = False,
    ) -> tuple[ManagedProcess, str]:
        """Start `spec` on its node; return it, with the address it announces, once it is ready.

        The process fetches `setup` with the control RPC `process_setup(spec.name)` and says
        it is ready with `process_ready(spec.name, address)` (see the module docstring).
        Raises as `start` does: ActorDied, with the log tail, if it exits first or does not
        announce itself within `ready_timeout` seconds.
        """
        existing = self._procs.get(spec.name)
        if spec.name in self._announcing or (existing is not None and existing.running):
            raise ValueError(f"a process named {spec.name!r} is already running")
        starting = _Announcing(dict(setup or {}))
        self._announcing[spec.name] = starting
        try:
            proc = await self._start(spec, None, starting.ready, ready_timeout, restartable)
            return proc, starting.ready.result()
        finally:
            if self._announcing.get(spec.name) is starting:
                del self._announcing[spec.name]

    async def connect(self, proc: ManagedProcess, address: str, *, timeout: float = 30.0) -> ActorHandle:  # noqa: ASYNC109  # the API takes per-call timeouts
        """Connect to the RPC server `proc` serves at `address`, with the run's secret.

        The supervisor keeps the handle informed: once `proc` has exited, its calls fail with
        ActorDied (exit code and log tail, as `watch()` reports it); stopping `proc`, or
        leaving the supervisor, closes it.
        """
        handle = await connect(address, self._secret, name=proc.name, timeout=timeout)
        handle.expect_exit_report()
        proc.handle = handle
        if not proc.running:  # it died between saying where it serves and our connecting
            handle.mark_dead(exit_error(proc.exit.result()))
        return handle

    def monitor(self, proc: ManagedProcess, ping: Callable[[], Awaitable[None]], *, name: str) -> None:
        """Call `ping()` with the supervisor's heartbeat settings while `proc` runs.

        When it stops answering (`Heartbeat.misses` pings in a row fail or are late), a
        HeartbeatLost named `name` is reported as an unexpected exit is: through `watch()` and
        `on_unresponsive`, unless `proc` has ended or is being stopped by then. The monitor
        ends when `proc` exits or is stopped. Does nothing when `proc` has already ended.
        """
        if not proc.running:
            return
        if self._tg is None:
            raise RuntimeError("the supervisor is not running")
        hb = self.heartbeat
        monitor = LivenessMonitor(
            ping,
            interval=hb.interval,
            timeout=hb.timeout,
            first_wait=hb.first_wait,
            misses=hb.misses,
            name=name,
        )
        if proc.monitor is not None:
            proc.monitor.cancel()
        proc.monitor = self._tg.create_task(self._watch_process(proc, monitor))

    async def _watch_process(self, proc: ManagedProcess, monitor: LivenessMonitor) -> None:
        try:
            await monitor.run()
        except HeartbeatLost as lost:
            if proc.running and not proc.stopping:
                log.error("%s (pid %d on node %r)", lost, proc.pid, proc.node)
                self._failures.put_nowait(lost)
                if self._on_unresponsive_cb is not None:
                    self._on_unresponsive_cb(lost)


def local_log_tail(run_dir: Path, name: str) -> str:
    """The tail of a process log written on this machine."""
    return read_log_tail(log_path(run_dir, name))


__all__ = [
    "LOCAL",
    "ExitInfo",
    "Heartbeat",
    "ManagedProcess",
    "ProcessSpec",
    "Supervisor",
    "exit_error",
    "local_log_tail",
]

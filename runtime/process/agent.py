"""The node agent: starts and reaps one node's processes for the head.

`tether agent --head tcp://HOST:PORT [--node-name N] [--bind-host H]` runs one per node
(srun, systemd or ssh start it; the run secret comes in `TETHER_SECRET`). It registers the
node's inventory with the head, serves `NodeAgent`'s methods over RPC, forwards every exit
to the head, and heartbeats both ways. On a single machine the head runs the same `NodeAgent`
class inside itself.

Dropped by the head (its heartbeat answered "not registered": the head gave it up while it was
frozen or cut off) or giving the head up itself (no answer for the heartbeat tolerance), the
agent stops its processes — the head has written them off, and they may hold ports — and
registers again, once the head answers, naming its last registration. The head then starts
its engines again. A head that does not answer within `--rejoin-timeout` seconds is gone: the
agent exits 3 (EXIT_HEAD_LOST).

With `--join` the node is new to a running run: the head places engines on it (on the devices
`--devices` offers, or a CPU run's slots), starts them, catches them up and routes to them; a
run that cannot grow refuses the registration, and the agent exits 2 with the head's reason.
SIGUSR2 (or `tether drain RUN_DIR NODE`) drains the node: the agent asks the head to, the head
ends the node's engines and tells the agent to exit, and it exits 0.

Every process runs under `tether.runtime.process.shim` in its own session and process group, with
its output in `<run_dir>/logs/<name>.log`, and with its gloo and NCCL sockets on the interface
holding its node's planned address (`ProcessSpec.address`, see runtime/netif.py). A process
whose spec sets `zygote` is forked instead from one of the agent's zygotes (runtime/process/zygote.py,
each started at its first use), which stands in for the shim; when the zygote cannot start it, it
is spawned. Processes that hold the run secret come from the runtime zygote; those that must not
(a CPU engine) from the secret-less one, which imports nothing up front and has never seen the
secret (`SECRETLESS_ZYGOTE_ENV` is its environment on top of the agent's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.runtime.errors import ConfigError, HeartbeatLost, RemoteError, UserError, exit_on_user_error
from tether.runtime.netif import socket_ifname_env
from tether.runtime.process import shim
from tether.runtime.process.spec import ExitInfo, ProcessSpec, log_path, read_log_tail
from tether.runtime.process.zygote_client import (
    SECRETLESS_ZYGOTE_ENV,
    SECRETLESS_ZYGOTE_LOG,
    ZYGOTE_LOG,
    ZygoteChild,
    ZygoteClient,
    ZygoteUnavailable,
)
from tether.runtime.rpc.liveness import LivenessMonitor
from tether.runtime.rpc.secret import SECRET_ENV, secret_to_env

if TYPE_CHECKING:
    from tether.runtime.rpc.actors import ActorHandle

log = logging.getLogger(__name__)

InventoryProvider = Callable[[], dict[str, Any]]
BIND_HOST_ENV = "TETHER_BIND_HOST"
EXIT_HEAD_LOST = 3
DRAIN_TIMEOUT = 600.0  # seconds a drain may take: the node's in-flight requests end first


def default_inventory(node: str, address: str = "127.0.0.1") -> dict[str, Any]:
    """What an agent reports before placement supplies a device probe."""
    return {"node": node, "hostname": socket.gethostname(), "address": address, "devices": []}


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _command_pid(shim_pid: int) -> int:
    """The command a shim runs: its earliest-started child (orphans the shim reaps descend from
    the command, so they started later). The shim itself, which forwards signals to its group,
    while it has no child yet or is gone."""
    try:
        children = Path(f"/proc/{shim_pid}/task/{shim_pid}/children").read_text().split()
    except OSError:
        return shim_pid
    started: list[tuple[int, int]] = []
    for pid in map(int, children):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        # Field 22 (starttime); the fields start after the command name's last ')'.
        started.append((int(stat[stat.rindex(b")") + 2 :].split()[19]), pid))
    return min(started)[1] if started else shim_pid


@dataclass
class _Child:
    spec: ProcessSpec
    proc: asyncio.subprocess.Process | ZygoteChild  # the shim, or the command forked by the zygote
    log: Path
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    info: ExitInfo | None = None


class NodeAgent:
    """Starts processes on this node, each under the shim; reports each exit to `on_exit`.

    Use as `async with NodeAgent(...) as agent:`; leaving the block stops every process
    (SIGTERM, `grace` seconds, SIGKILL to the process group). Public async methods are the
    agent's RPC interface. With `zygote`, the first start of a spec that sets `zygote` launches
    the zygote it needs (a run that starts no such process pays nothing for it); leaving stops
    the zygotes after the processes, within `grace` + 5 s.
    """

    def __init__(
        self,
        node: str,
        run_dir: Path,
        secret: bytes,
        *,
        on_exit: Callable[[ExitInfo], Awaitable[None]],
        inventory: InventoryProvider | None = None,
        grace: float = 10.0,
        bind_host: str = "127.0.0.1",
        zygote: bool = True,
    ) -> None:
        self.node = node
        self.run_dir = Path(run_dir)
        self.grace = grace
        self.bind_host = bind_host
        self._secret = secret
        self._on_exit = on_exit
        self._inventory = inventory or (lambda: default_inventory(node, bind_host))
        self._children: dict[str, _Child] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._use_zygote = zygote
        self.zygote: ZygoteClient | None = None  # forks the processes that get the run secret
        self.secretless_zygote: ZygoteClient | None = None  # and those that do not
        self.shutdown_requested = asyncio.Event()

    async def __aenter__(self) -> NodeAgent:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.stop_all(self.grace)
            zygotes = [z for z in (self.zygote, self.secretless_zygote) if z is not None]
            if zygotes:
                async with asyncio.TaskGroup() as closing:
                    for zygote in zygotes:
                        closing.create_task(zygote.close(self.grace + 5.0))
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                await tg.__aexit__(None, None, None)

    # -- RPC interface --------------------------------------------------------------------
    async def inventory(self) -> dict[str, Any]:
        return self._inventory()

    async def processes(self) -> dict[str, int]:
        """Name → pid of every running process: of its shim, or of the command itself when the
        zygote forked it (either leads the process group)."""
        return {name: child.proc.pid for name, child in self._children.items()}

    async def start_process(self, spec: ProcessSpec) -> int:
        """Start `spec` under the shim, or forked from a zygote (`spec.zygote`); return the
        pid that leads its process group (the shim's, or the forked command's)."""
        spec.validate()
        if self._tg is None:
            raise RuntimeError(f"agent {self.node!r} is not running")
        if spec.name in self._children:
            raise ValueError(f"process name {spec.name!r} is already running on node {self.node!r}")
        if spec.zygote and self._use_zygote:
            self._launch_zygote(spec.run_secret)  # its imports overlap the rest of this start
        env = {**os.environ, **spec.env}
        # Collectives on the node's planned address (a host name there resolves: off the loop).
        env.update(await asyncio.to_thread(socket_ifname_env, spec.address, env))
        if spec.run_secret:
            env[SECRET_ENV] = secret_to_env(self._secret)
        else:
            env.pop(SECRET_ENV, None)  # an agent started by SLURM or systemd holds it in os.environ
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault(BIND_HOST_ENV, self.bind_host)
        env["TETHER_PROCESS_NAME"] = spec.name
        env["TETHER_NODE"] = self.node
        path = log_path(self.run_dir, spec.name)
        proc: asyncio.subprocess.Process | ZygoteChild | None = None
        if spec.zygote:
            proc = await self._fork(spec, env, path)
        if proc is None:
            # The shim needs only the standard library: run its file without `site` (-S), which
            # saves most of an interpreter start on every process launched.
            argv = [
                sys.executable, "-S", shim.__file__,
                "--parent-pid", str(os.getpid()), "--grace", repr(self.grace), "--", *spec.argv,
            ]  # fmt: skip
            with open(path, "ab") as logf:  # noqa: ASYNC230  # a local log file opens at once
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=spec.cwd,
                    start_new_session=True,  # own session and group: killed as a group
                )
        child = _Child(spec, proc, path)
        self._children[spec.name] = child
        self._tg.create_task(self._reap(child), name=f"reap:{spec.name}")
        return proc.pid

    def _launch_zygote(self, run_secret: bool) -> None:
        """The zygote for processes with (or without) the run secret, launched at its first use."""
        if run_secret and self.zygote is None:
            self.zygote = ZygoteClient(log=self.run_dir / "logs" / ZYGOTE_LOG, grace=self.grace)
            self.zygote.launch()
        elif not run_secret and self.secretless_zygote is None:
            self.secretless_zygote = ZygoteClient(
                log=self.run_dir / "logs" / SECRETLESS_ZYGOTE_LOG,
                grace=self.grace,
                environ={**os.environ, **SECRETLESS_ZYGOTE_ENV},
                runtime_preload=False,
            )
            self.secretless_zygote.launch()

    async def _fork(self, spec: ProcessSpec, env: dict[str, str], path: Path) -> ZygoteChild | None:
        """`spec` forked from its zygote; None (logged) when it must be spawned instead."""
        zygote = self.zygote if spec.run_secret else self.secretless_zygote
        if zygote is None:
            log.info("process %r: agent %r runs no zygote; spawning it", spec.name, self.node)
            return None
        try:
            return await zygote.spawn(
                name=spec.name,
                argv=spec.argv,
                env=env,
                # As a spawn resolves them: against the agent's working directory now.
                cwd=os.path.abspath(spec.cwd) if spec.cwd else os.getcwd(),  # noqa: ASYNC240  # no I/O
                log=str(path),
                preload=spec.preload,
            )
        except ZygoteUnavailable as exc:
            log.warning("process %r: not forked from the zygote (%s); spawning it", spec.name, exc)
            return None

    async def stop_process(self, name: str, grace: float | None = None) -> ExitInfo:
        """SIGTERM the command (which stops its own children), wait `grace` seconds, then
        SIGKILL its whole group; return how it ended."""
        child = self._children.get(name)
        if child is None:
            raise KeyError(f"no process named {name!r} on node {self.node!r}")
        return await self._stop(child, self.grace if grace is None else grace)

    async def stop_all(self, grace: float | None = None) -> None:
        children = list(self._children.values())
        if children:
            async with asyncio.TaskGroup() as tg:
                for child in children:
                    tg.create_task(self._stop(child, self.grace if grace is None else grace))

    async def shutdown(self) -> None:
        """Ask a standalone agent to stop its processes and exit."""
        self.shutdown_requested.set()

    # -- internals ------------------------------------------------------------------------
    def _child(self, name: str) -> _Child:
        child = self._children.get(name)
        if child is None:
            raise KeyError(f"no process named {name!r} on node {self.node!r}")
        return child

    async def _stop(self, child: _Child, grace: float) -> ExitInfo:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if child.exited.is_set():
                break
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGTERM and isinstance(child.proc, ZygoteChild):
                    child.proc.send_signal(sig)  # the command itself, through its pidfd
                elif sig == signal.SIGTERM:
                    # To the command alone, once: it stops its own children its own way (SGLang
                    # drains and ends its scheduler, torchrun its ranks), and the shim then ends
                    # whatever it left. Sent to the whole group, the children would die under
                    # their parent, which reports a crash; and each process would get it twice,
                    # the second after a clean shutdown removed its handler (death by SIGTERM).
                    os.kill(_command_pid(child.proc.pid), sig)
                else:
                    os.killpg(child.proc.pid, sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await child.exited.wait()
        await child.exited.wait()
        assert child.info is not None
        return child.info

    async def _reap(self, child: _Child) -> None:
        rc = await child.proc.wait()
        # The shim (or the forked command) is gone; a straggler in its group dies now.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.info = ExitInfo(
            name=child.spec.name,
            node=self.node,
            pid=child.proc.pid,
            returncode=rc if rc >= 0 else None,
            signal=-rc if rc < 0 else None,
            log_tail=read_log_tail(child.log),
            reason=child.proc.reason if isinstance(child.proc, ZygoteChild) else "",
        )
        self._children.pop(child.spec.name, None)
        child.exited.set()
        try:
            await self._on_exit(child.info)
        except Exception:
            log.exception("agent %r could not report the exit of %r", self.node, child.spec.name)


# -- the standalone agent process ---------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", required=True, help="The head's control address, tcp://HOST:PORT.")
    parser.add_argument(
        "--node-name", default=socket.gethostname(), help="This node's name (default: hostname)."
    )
    parser.add_argument(
        "--bind-host",
        default=None,
        help="Interface to serve on (default: this machine's address toward the head).",
    )
    parser.add_argument("--run-dir", default=None, help="Run directory for logs (default: the head's).")
    parser.add_argument("--grace", type=float, default=10.0, help="Seconds between SIGTERM and SIGKILL.")
    parser.add_argument(
        "--join",
        action="store_true",
        help="Join a running run as a new node: the head adds engines here (see docs/operations.md).",
    )
    parser.add_argument(
        "--devices",
        type=_device_list,
        default=None,
        help="With --join: the devices the run may use here, e.g. 0,1 (GPU indices, or a CPU run's "
        "slots); default on a CPU run: its --cpu-devices slots. Required to join a GPU run.",
    )
    parser.add_argument(
        "--rejoin-timeout",
        type=float,
        default=300.0,
        help="Seconds to wait for a head it lost to answer again, and then register again, before "
        "exiting 3 (0: exit at once).",
    )


def _device_list(text: str) -> list[int]:
    try:
        devices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected device indices such as 0,1") from None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct device indices such as 0,1")
    return devices


class AgentDropped(Exception):
    """The head no longer has this agent registered (it counted the node as lost)."""


@dataclass
class _Membership:
    """This agent's registration with the head, kept up for as long as the agent runs."""

    head: ActorHandle
    agent: NodeAgent
    address: str  # where the agent serves
    setup: dict[str, Any]  # the head's heartbeat settings
    rejoin_timeout: float
    join: bool = False
    """A node new to the run (--join): the head adds its capacity at its first registration."""
    token: int | None = None
    detached: bool = False
    """Between giving the registration up and registering again: exits are not reported."""

    async def register(self) -> None:
        self.token = int(
            await self.head.call(
                "register_agent",
                self.agent.node,
                self.address,
                await self.agent.inventory(),
                self.token,
                self.join,
                timeout=30.0,
            )
        )

    async def keep(self) -> None:
        """Stay registered: on being dropped or losing the head, stop every process and register
        again. Raises HeartbeatLost once the head has not answered for --rejoin-timeout."""
        while True:
            try:
                await self._watch()
            except* (HeartbeatLost, AgentDropped) as group:
                why: BaseException = group.exceptions[0]
            if self.agent.shutdown_requested.is_set():
                return  # let go by the head (drained): the agent exits, it does not register again
            if isinstance(why, HeartbeatLost) and self.rejoin_timeout <= 0:
                raise why
            log.error("agent %r: %s; stopping its processes to register again", self.agent.node, why)
            self.detached = True
            await self.agent.stop_all()
            await self._reach_head(why)
            await self.register()
            self.detached = False
            log.info("agent %r registered again (registration %d)", self.agent.node, self.token)

    async def _watch(self) -> None:
        """Heartbeats to the head until it stops answering (HeartbeatLost) or says this
        registration is gone (AgentDropped)."""
        dropped = asyncio.Event()
        node, token, timeout = self.agent.node, self.token, float(self.setup["timeout"])

        async def heartbeat() -> None:
            if not await self.head.call("agent_heartbeat", node, token, timeout=timeout):
                dropped.set()

        async def until_dropped() -> None:
            await dropped.wait()
            raise AgentDropped(f"the head no longer has registration {token} of node {node!r}")

        monitor = LivenessMonitor(
            heartbeat,
            interval=self.setup["interval"],
            timeout=timeout,
            first_wait=self.setup["interval"],
            misses=int(self.setup.get("misses", 3)),
            name="head",
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(monitor.run())
            tg.create_task(until_dropped())

    async def _reach_head(self, why: BaseException) -> None:
        """Return once the head answers a ping; HeartbeatLost after --rejoin-timeout."""
        timeout = float(self.setup["timeout"])
        try:
            async with asyncio.timeout(self.rejoin_timeout):
                while True:
                    try:
                        await self.head.ping(timeout=timeout)
                        return
                    except Exception:  # unreachable still (or the connection is being remade)
                        await asyncio.sleep(float(self.setup["interval"]))
        except TimeoutError:
            raise HeartbeatLost(
                "head", f"{why}; no answer within --rejoin-timeout={self.rejoin_timeout:g} s"
            ) from None


async def serve(args: argparse.Namespace) -> int:
    from tether.runtime.process.signals import StopRequested, handle_signals
    from tether.runtime.rpc.actors import RpcServer, connect
    from tether.runtime.rpc.secret import secret_from_env

    if not str(args.head).startswith("tcp://"):
        raise ConfigError("--head", args.head, "expected tcp://HOST:PORT, the head's control address")
    secret = secret_from_env()
    head_host = str(args.head)[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    bind_host = args.bind_host or address_toward(head_host)
    head = await connect(args.head, secret, name="head", timeout=30.0)
    async with head:

        async def report_exit(info: ExitInfo) -> None:
            if membership.detached:
                # Stopped as the registration was given up: the head counts them lost with it.
                return
            await head.call("process_exited", info, timeout=30.0)

        setup = await head.call("agent_setup", timeout=30.0)
        run_dir = Path(args.run_dir or setup["run_dir"])
        inventory = None
        if getattr(args, "join", False):
            offered = {"join_devices": args.devices}
            inventory = lambda: {**default_inventory(args.node_name, bind_host), **offered}  # noqa: E731
        agent = NodeAgent(
            args.node_name,
            run_dir,
            secret,
            on_exit=report_exit,
            grace=args.grace,
            bind_host=bind_host,
            inventory=inventory,
        )
        async with (
            agent,
            RpcServer(agent, f"tcp://{bind_host}:0", secret, name=f"agent:{args.node_name}") as server,
        ):
            membership = _Membership(
                head, agent, server.address, setup, float(args.rejoin_timeout), join=bool(args.join)
            )
            # SIGUSR2 asks for a drain: handled from before the registration, which may add
            # engines here at once (its default action would kill the agent).
            drain_asked = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR2, drain_asked.set)
            try:
                await membership.register()
            except RemoteError as exc:  # refused (a join the run cannot take, a name taken)
                raise UserError(f"the head refused node {args.node_name!r}: {exc.message}") from None
            log.info("agent %r serving on %s for head %s", args.node_name, server.address, args.head)

            async def until_shutdown() -> None:
                await agent.shutdown_requested.wait()
                raise StopRequested(signal.SIGTERM)

            async def no_checkpoint() -> None:
                return None

            async def drain_on_signal() -> None:
                """SIGUSR2: ask the head to drain this node; it tells the agent to exit."""
                try:
                    await drain_asked.wait()
                finally:
                    loop.remove_signal_handler(signal.SIGUSR2)
                log.info("agent %r: SIGUSR2, asking the head to drain this node", args.node_name)
                try:
                    await head.call("drain_node", args.node_name, timeout=DRAIN_TIMEOUT)
                except Exception as exc:  # the run keeps the node; the operator reads why here
                    log.error("agent %r: the head did not drain this node: %s", args.node_name, exc)

            rc = 0
            try:
                async with handle_signals(no_checkpoint) as stop, asyncio.TaskGroup() as tg:
                    tg.create_task(stop.raise_when_requested())
                    tg.create_task(until_shutdown())
                    tg.create_task(membership.keep())
                    tg.create_task(drain_on_signal())
            except* StopRequested:
                rc = 0
            except* HeartbeatLost as group:
                log.error("agent %r: %s; stopping its processes", args.node_name, group.exceptions[0])
                rc = EXIT_HEAD_LOST
    return rc


def main(args: argparse.Namespace) -> int:
    from tether.runtime.loop import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(serve(args))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tether.runtime.process.agent")
    add_arguments(_parser)
    _args = _parser.parse_args()
    raise SystemExit(exit_on_user_error("tether agent", lambda: main(_args)))

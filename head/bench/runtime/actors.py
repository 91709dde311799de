"""Python actors for the benchmarks and tests: a process that builds a Python object and serves it.

    async with Supervisor(run_dir, secret) as sup:
        ref = await start_actor(sup, "ref", "my.module:RefModel", {"path": p}, node="node1")
        await ref.score(batch)
        await sup.watch()          # raises ActorDied / HeartbeatLost at the first failure

The process is `python -m tether.bench.runtime.actor_host`, started through the supervisor like any
other (forked from its node's zygote: `ProcessSpec.zygote`): it fetches its constructor arguments with the head's `process_setup`, serves the object
with `RpcServer` and announces its address with `process_ready` (see
`Supervisor.start_announced`). The product starts no Python actors; `tether bench runtime`
and the runtime's tests do.
"""

from __future__ import annotations

import sys
from typing import Any

from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import LOCAL, Supervisor
from tether.runtime.rpc.actors import ActorHandle
from tether.runtime.rpc.endpoints import ipc_endpoint

TRANSPORTS = ("auto", "tcp", "ipc")
_HOST_MODULE = "tether.bench.runtime.actor_host"


async def start_actor(
    sup: Supervisor,
    name: str,
    target: str,
    args: dict[str, Any] | None = None,
    *,
    node: str = LOCAL,
    env: dict[str, str] | None = None,
    ready_timeout: float = 120.0,
    heartbeat: bool = True,
    transport: str = "auto",
) -> ActorHandle:
    """Start a process that builds `target` ("module.path:ClassName") with `**args` and
    serves it; return a handle to it once it answers.

    `transport="ipc"` serves on a Unix socket in the run directory (same node only);
    "auto" (the default) takes ipc on this node when the socket path fits, tcp elsewhere.
    With `heartbeat`, an actor that stops answering pings is reported (see `Supervisor.watch`).
    Raises ActorDied, with the log tail, if the actor exits before it is ready or is not
    ready within `ready_timeout` seconds.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: expected 'auto', 'tcp' or 'ipc'")
    if transport == "ipc" and node != LOCAL:
        raise ValueError(f"transport='ipc' with node={node!r}: ipc reaches this machine only")
    argv = [sys.executable, "-m", _HOST_MODULE, "--name", name, "--target", target]
    argv += ["--head", sup.address]
    if transport != "tcp" and node == LOCAL:
        sock_dir = sup.run_dir / "sock"
        endpoint = ipc_endpoint(sock_dir, name)
        if endpoint is None and transport == "ipc":
            raise ValueError(f"run directory {sup.run_dir}: too long a path for a Unix socket")
        if endpoint is not None:
            sock_dir.mkdir(exist_ok=True)
            argv += ["--bind", endpoint]
    # Forked from the node's zygote, which has imported the runtime: a fork, not an interpreter
    # start (spawned when the zygote cannot give the same process; see ProcessSpec.zygote). The
    # zygote also imports the host and, when it is tether's own (no side effects at import),
    # the target's module: the next actor of the kind starts with them imported.
    preload = [_HOST_MODULE]
    target_module = target.partition(":")[0]
    if target_module.startswith("tether."):
        preload.append(target_module)
    spec = ProcessSpec(name=name, argv=argv, env=dict(env or {}), node=node, zygote=True, preload=preload)
    proc, address = await sup.start_announced(spec, dict(args or {}), ready_timeout)
    handle = await sup.connect(proc, address)
    if heartbeat:
        sup.monitor(proc, handle.ping, name=f"actor {name!r}")
    return handle


__all__ = ["start_actor"]

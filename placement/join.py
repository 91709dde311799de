"""Placement of a node that joins a running run (`tether agent --join`): its engines.

The plan made at start stays as it was (it is the receipt's); a joined node is planned on its
own, after the plan's nodes and the nodes joined before it, the way `plan_from_config` plans
rollout devices: its devices in the sorter's order, cut into engines of
--rollout-num-gpus-per-engine, each with ports from the --node-port-first range (past every
port the run uses on that machine, when it shares a machine with a node of the run). Joined
engines are regular engines, numbered after every engine of the run.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Node
from tether.placement.plan import (
    Bundle,
    Engine,
    Plan,
    PlanNode,
    _engine,
    _machine,
    _Ports,
    uses_dp_attention,
)
from tether.placement.server_groups import ServerGroup
from tether.placement.sorter import sort_nodes
from tether.runtime.errors import ConfigError

JOINED_GROUP = "joined"


def plan_ports(plan: Plan, engines: Sequence[Engine] = ()) -> dict[str, int]:
    """Machine → the highest port the run uses there (the plan's, and `engines` joined since)."""
    used: dict[str, int] = {}

    def note(address: str, port: int | None) -> None:
        if port is not None:
            machine = _machine(address)
            used[machine] = max(used.get(machine, 0), port)

    for group in plan.train_groups:
        rdzv_host, _, rdzv_port = group.rdzv_endpoint.rpartition(":")
        note(rdzv_host.strip("[]"), int(rdzv_port))
    if plan.weight_sync is not None:
        note(plan.weight_sync.master_addr, plan.weight_sync.master_port)
    for engine in [*plan.engines, *engines]:
        if engine.external:
            continue
        ports = [engine.http_port, engine.nccl_port, *engine.dp_attention_ports]
        if engine.dist_init_addr is not None:
            ports.append(int(engine.dist_init_addr.rpartition(":")[2]))
        for port in ports:
            note(engine.host, port)
    return used


def place_joined(
    plan: Plan,
    cluster: ClusterConfig,
    *,
    hostname: str,
    address: str,
    devices: Sequence[int] | None,
    joined: Sequence[PlanNode] = (),
    joined_engines: Sequence[Engine] = (),
    sglang_args: Sequence[str] = (),
) -> tuple[PlanNode, list[Engine]]:
    """The joined node (indexed after the plan's and `joined`) and the engines it runs.

    `devices`: the devices the node's agent offers (GPU indices, or CPU slots); None on a CPU
    plan means the plan's --cpu-devices slots, as every node of the run has. Raises ConfigError
    naming the flag when the node cannot hold one engine."""
    if plan.device_kind == "cpu":
        offered = list(range(cluster.cpu_devices or 0)) if devices is None else list(devices)
    elif devices is None:
        raise ConfigError(
            "--devices",
            None,
            f"node {hostname!r} joins a GPU run: its agent must say which GPUs the run may use "
            "(`tether agent --join --devices 0,1,...`)",
        )
    else:
        offered = list(devices)
    # The sorter's device order (physical index), as at start.
    (node,) = sort_nodes([Node(hostname=hostname, address=address, gpus=[Gpu(index=d) for d in offered])])
    ordered = [gpu.index for gpu in node.gpus]
    size = cluster.rollout_num_gpus_per_engine
    count = len(ordered) // size
    if count == 0:
        raise ConfigError(
            "--rollout-num-gpus-per-engine",
            size,
            f"node {hostname!r} offers {len(ordered)} device(s) {ordered}: not enough for one engine",
        )
    index = len(plan.nodes) + len(joined)
    new = PlanNode(index, hostname, address, ordered)
    nodes = [*plan.nodes, *joined, new]
    if [n.index for n in nodes] != list(range(len(nodes))):
        raise ValueError(f"node indices {[n.index for n in nodes]} are not 0..{len(nodes) - 1}")
    used = plan_ports(plan, joined_engines).get(_machine(address))
    first = cluster.node_port_first if used is None else max(cluster.node_port_first, used + 1)
    ports = _Ports(nodes, first, cluster.node_port_last)
    group = ServerGroup(name=JOINED_GROUP, num_gpus=count * size)
    dp_attention = uses_dp_attention(sglang_args, {})
    first_engine = 1 + max((e.index for e in [*plan.engines, *joined_engines]), default=-1)
    engines = []
    for k in range(count):
        chunk = [Bundle(node=index, device=d) for d in ordered[k * size : (k + 1) * size]]
        engine = _engine(
            first_engine + k, group, size, chunk, nodes, plan.device_kind, ports, cluster, dp_attention
        )
        engines.append(engine)
    return new, engines


__all__ = ["JOINED_GROUP", "place_joined", "plan_ports"]

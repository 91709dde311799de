"""Placement plans: which process runs where, on which devices, with which ports.

A plan is computed once, before any process starts, from the cluster flags and the inventory.
It is a msgspec Struct (it goes into every run's receipt as JSON) and holds everything the head
needs to start processes: per trainer node the torchrun arguments, per engine its node(s),
devices, ports and SGLang spanning arguments, and the weight-sync group layout.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Inventory, Node, resolve_host
from tether.placement.server_groups import (
    OverrideValue,
    ServerGroup,
    WorkerType,
    check_group,
    load_server_groups,
)
from tether.placement.sorter import sort_nodes
from tether.runtime.errors import ConfigError

PLAN_FORMAT_VERSION = 1

# SGLang (0.5.23) with attention data parallelism connects its processes over TCP on ports at
# fixed offsets above --dist-init-addr's port, which a plan would otherwise hand to the next
# engine: +1..+6 (PortArgs.init_new: tokenizer, detokenizer, rpc, metrics, scheduler input,
# load collector), +7.. (SGLANG_RUST_SERVER's per-DP-rank inputs) and +13 (the DP controller's
# worker-port handshake, DP_ATTENTION_HANDSHAKE_PORT_DELTA). The plan keeps +1..+13 for it.
DP_ATTENTION_PORT_SPAN = 13
_DP_ATTENTION_FLAGS = ("enable-dp-attention", "attn-dp-size")

DeviceKind = Literal["gpu", "cpu"]
PlanMode = Literal["decoupled", "colocated", "external", "debug-rollout-only", "debug-train-only"]
TrainRole = Literal["actor", "critic", "reference"]


class PlanNode(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node in rank order, with the devices plans may use on it."""

    index: int
    hostname: str
    address: str
    devices: list[int]  # physical GPU indices, or CPU slot numbers on a CPU plan
    gpu_uuids: list[str] = msgspec.field(default_factory=list)


class Bundle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One device of one node (node is an index into Plan.nodes)."""

    node: int
    device: int


class TorchrunNode(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One torchrun launch: the trainer ranks of one group on one node."""

    node: int
    hostname: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    first_rank: int  # global rank of local rank 0
    devices: list[int]  # in local-rank order
    cuda_visible_devices: str | None  # None on a CPU plan
    rdzv_endpoint: str  # host:port on the group's first node
    env: dict[str, str]

    def torchrun_args(self) -> list[str]:
        """Arguments for torchrun; static rendezvous so that node ranks (hence global ranks) follow the plan."""
        host, _, port = self.rdzv_endpoint.rpartition(":")
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--master-addr={host.strip('[]')}",
            f"--master-port={port}",
        ]


class TrainGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One torchrun job (actor, critic or reference) across its nodes."""

    role: TrainRole
    nnodes: int
    nproc_per_node: int
    world_size: int
    rdzv_endpoint: str
    nodes: list[TorchrunNode]
    shares_devices_with: TrainRole | None = None


class EnginePart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The process of one engine on one node (an engine spanning nodes has one part per node)."""

    node: int
    hostname: str
    node_rank: int
    devices: list[int]
    cuda_visible_devices: str | None
    env: dict[str, str]


class Engine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rollout engine (an SGLang server or the CPU engine), started by tether or external."""

    index: int
    group: str
    worker_type: WorkerType
    external: bool
    tp_size: int
    host: str
    http_port: int
    address: str  # host:port clients use
    nccl_port: int | None
    dist_init_addr: str | None
    nnodes: int
    parts: list[EnginePart]
    weight_sync_rank_offset: int | None
    overrides: dict[str, OverrideValue] = msgspec.field(default_factory=dict)
    dp_attention_ports: list[int] = msgspec.field(default_factory=list)
    """Ports SGLang's attention data parallelism binds above the dist-init port (on the first
    node), kept for it: no other process of the plan gets them. Empty without DP attention."""

    def launch_args(self, part: EnginePart) -> list[str]:
        """SGLang server arguments for one part of a tether-started engine (the same on CPU)."""
        args = ["--host", self.host, "--port", str(self.http_port), "--tp-size", str(self.tp_size)]
        if self.nccl_port is not None:
            args += ["--nccl-port", str(self.nccl_port)]
        if self.dist_init_addr is not None:
            args += ["--dist-init-addr", self.dist_init_addr]
        if self.nnodes > 1:
            args += ["--nnodes", str(self.nnodes), "--node-rank", str(part.node_rank)]
        return args


class Reservation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Devices a placeholder server group holds without starting an engine."""

    group: str
    bundles: list[Bundle]


class EngineSyncRanks(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one engine's ranks sit in the weight-sync group."""

    engine: int
    rank_offset: int
    size: int


class WeightSyncLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The trainer → engines broadcast group: trainer rank 0 is group rank 0, engines follow in order."""

    world_size: int
    master_addr: str
    master_port: int
    engines: list[EngineSyncRanks]


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where every process of a run goes. Deterministic: equal inputs give byte-equal JSON."""

    format_version: int
    device_kind: DeviceKind
    mode: PlanMode
    colocate: bool
    offload_train: bool
    offload_rollout: bool
    nodes: list[PlanNode]
    train_groups: list[TrainGroup]
    engines: list[Engine]
    reserved: list[Reservation]
    weight_sync: WeightSyncLayout | None

    def train_group(self, role: TrainRole) -> TrainGroup | None:
        """The group of one role, or None when the plan has none."""
        return next((group for group in self.train_groups if group.role == role), None)

    def to_json(self) -> bytes:
        """The plan as stable JSON (field order fixed by the structs)."""
        return msgspec.json.encode(self)


def host_port(host: str, port: int) -> str:
    """host:port, with IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Ports:
    """Per-node port cursors inside [first, last]; a port is handed out once per node."""

    def __init__(self, nodes: list[PlanNode], first: int, last: int) -> None:
        self._nodes = nodes
        self._first = first
        self._last = last
        # Every loopback address is this one machine: nodes declared there (a one-machine test of
        # a multi-node plan) share one cursor, else a port bound on 0.0.0.0 by one clashes with
        # the same number bound by another.
        self._machine = [_machine(node.address) for node in nodes]
        self._next = dict.fromkeys(self._machine, first)

    def take(self, on: list[int], what: str) -> int:
        """One port free on every node in `on` (a spanning engine binds the same port number on each)."""
        machines = {self._machine[n] for n in on}
        port = max(self._next[m] for m in machines)
        if port > self._last:
            names = ", ".join(self._nodes[n].hostname for n in on)
            size = self._last - self._first + 1
            raise ConfigError(
                "--node-port-last",
                self._last,
                f"port range {self._first}-{self._last} ({size} ports) on {names} is exhausted "
                f"while assigning the {what}",
            )
        for m in machines:
            self._next[m] = port + 1
        return port


def _machine(address: str) -> str:
    try:
        return "loopback" if ipaddress.ip_address(address).is_loopback else address
    except ValueError:
        return address


class _Devices:
    """Which devices of each node are still free, in rank order."""

    def __init__(self, nodes: list[PlanNode]) -> None:
        self.nodes = nodes
        self.free = [list(node.devices) for node in nodes]

    def total(self) -> int:
        return sum(len(node.devices) for node in self.nodes)

    def free_bundles(self) -> list[Bundle]:
        return [Bundle(node=i, device=d) for i, devs in enumerate(self.free) for d in devs]

    def take(self, bundles: list[Bundle]) -> None:
        for bundle in bundles:
            self.free[bundle.node].remove(bundle.device)

    def take_group(self, role: str, flag: str, nnodes: int, per_node: int) -> list[list[Bundle]]:
        """The first `nnodes` nodes with `per_node` free devices; their lowest free devices."""
        chosen = [i for i, devs in enumerate(self.free) if len(devs) >= per_node][:nnodes]
        if len(chosen) < nnodes:
            free = [len(devs) for devs in self.free]
            raise ConfigError(
                flag,
                nnodes,
                f"the {role} needs {nnodes} node(s) x {per_node} devices ({nnodes * per_node} in all), "
                f"but only {len(chosen)} of {len(self.nodes)} node(s) have {per_node} free "
                f"(free per node: {free}, {self.total()} devices in the cluster)",
            )
        groups = [[Bundle(node=i, device=d) for d in self.free[i][:per_node]] for i in chosen]
        for bundles in groups:
            self.take(bundles)
        return groups


def _plan_nodes(
    inventory: Inventory, cluster: ClusterConfig, resolve: Callable[[str], str | None]
) -> list[PlanNode]:
    ordered: list[Node] = sort_nodes(inventory.nodes, resolve)
    if cluster.cpu_devices is not None:
        slots = list(range(cluster.cpu_devices))
        return [PlanNode(i, n.hostname, n.address, list(slots)) for i, n in enumerate(ordered)]
    if not any(node.gpus for node in ordered):
        raise ConfigError(
            "--cpu-devices",
            None,
            f"no GPU found on any of the {len(ordered)} node(s); pass --cpu-devices N to plan on N CPU slots per node",
        )
    return [
        PlanNode(i, n.hostname, n.address, [g.index for g in n.gpus], _uuids(n))
        for i, n in enumerate(ordered)
    ]


def _uuids(node: Node) -> list[str]:
    # Declared inventories often omit UUIDs; an empty list reads better than a row of "".
    uuids = [g.uuid for g in node.gpus]
    return uuids if any(uuids) else []


def _device_env(kind: DeviceKind, devices: list[int]) -> tuple[str | None, dict[str, str]]:
    if kind == "cpu":
        # Hide every GPU of the host: torch then finds no CUDA, so trainer ranks pick gloo and
        # stay off cuda:local_rank, and sync groups with the engines use gloo too.
        return None, {"CUDA_VISIBLE_DEVICES": ""}
    visible = ",".join(str(d) for d in devices)
    # NVML numbers GPUs in PCI bus order; CUDA must use the same order for the indices to agree.
    return visible, {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _mode(cluster: ClusterConfig, debug_rollout_only: bool, debug_train_only: bool) -> PlanMode:
    if debug_rollout_only and debug_train_only:
        raise ConfigError("--debug-train-only", True, "cannot be combined with --debug-rollout-only")
    if debug_train_only:
        return "debug-train-only"
    if debug_rollout_only:
        return "debug-rollout-only"
    if cluster.uses_external_engines:
        return "external"
    return "colocated" if cluster.colocate else "decoupled"


def _train_group(
    role: TrainRole,
    slices: list[list[Bundle]],
    nodes: list[PlanNode],
    kind: DeviceKind,
    ports: _Ports,
    shares: TrainRole | None = None,
) -> TrainGroup:
    first = slices[0][0].node
    endpoint = host_port(nodes[first].address, ports.take([first], f"{role} torchrun rendezvous port"))
    per_node = len(slices[0])
    launches = []
    for rank, bundles in enumerate(slices):
        devices = [b.device for b in bundles]
        visible, env = _device_env(kind, devices)
        launches.append(
            TorchrunNode(
                node=bundles[0].node,
                hostname=nodes[bundles[0].node].hostname,
                nnodes=len(slices),
                node_rank=rank,
                nproc_per_node=per_node,
                first_rank=rank * per_node,
                devices=devices,
                cuda_visible_devices=visible,
                rdzv_endpoint=endpoint,
                env=env,
            )
        )
    return TrainGroup(
        role=role,
        nnodes=len(slices),
        nproc_per_node=per_node,
        world_size=len(slices) * per_node,
        rdzv_endpoint=endpoint,
        nodes=launches,
        shares_devices_with=shares,
    )


def _server_groups(cluster: ClusterConfig, rollout_gpus: int | None) -> list[ServerGroup]:
    per_engine = cluster.rollout_num_gpus_per_engine
    if cluster.sglang_config is None and cluster.prefill_num_servers is not None:
        return _prefill_decode_groups(cluster.prefill_num_servers, per_engine, rollout_gpus or 0)
    if cluster.sglang_config is None:
        if rollout_gpus is None or rollout_gpus == 0:
            return []
        if rollout_gpus % per_engine:
            raise ConfigError(
                "--rollout-num-gpus-per-engine",
                per_engine,
                f"does not divide --rollout-num-gpus={rollout_gpus} ({rollout_gpus % per_engine} devices left over)",
            )
        return [check_group(ServerGroup(num_gpus=rollout_gpus), per_engine, "--rollout-num-gpus")]
    groups = load_server_groups(cluster.sglang_config, per_engine)
    total = sum(group.num_gpus for group in groups)
    if rollout_gpus is not None and rollout_gpus != total:
        raise ConfigError(
            "--rollout-num-gpus",
            rollout_gpus,
            f"differs from the {total} devices the groups of --sglang-config {cluster.sglang_config} declare",
        )
    return groups


def _prefill_decode_groups(prefill_servers: int, per_engine: int, rollout_gpus: int) -> list[ServerGroup]:
    """--prefill-num-servers N: N prefill engines first, decode engines on the other rollout devices
    (slime's SglangConfig.from_prefill_num_servers)."""
    prefill = prefill_servers * per_engine
    if rollout_gpus - prefill <= 0:
        raise ConfigError(
            "--prefill-num-servers",
            prefill_servers,
            f"leaves no decode devices: {prefill_servers} x {per_engine} prefill devices of the "
            f"{rollout_gpus} rollout devices",
        )
    return [
        check_group(
            ServerGroup(worker_type="prefill", num_gpus=prefill), per_engine, "--prefill-num-servers"
        ),
        check_group(
            ServerGroup(worker_type="decode", num_gpus=rollout_gpus - prefill),
            per_engine,
            "--prefill-num-servers",
        ),
    ]


def _rollout_bundles(
    mode: PlanMode,
    cluster: ClusterConfig,
    devices: _Devices,
    actor: TrainGroup | None,
    groups: list[ServerGroup],
) -> list[Bundle]:
    need = sum(group.num_gpus for group in groups)
    shared: list[Bundle] = []
    if mode == "colocated" and actor is not None:
        shared = [Bundle(node=launch.node, device=d) for launch in actor.nodes for d in launch.devices]
    extra = max(0, need - len(shared))
    free = devices.free_bundles()
    if extra > len(free):
        used = devices.total() - len(free)
        raise ConfigError(
            "--rollout-num-gpus",
            need,
            f"rollout needs {need} devices"
            + (f" ({len(shared)} shared with the actor)" if shared else "")
            + f", but the cluster has {devices.total()}, {used} of them taken by trainer groups, {len(free)} free",
        )
    taken = free[:extra]
    devices.take(taken)
    return (shared + taken)[:need]


def uses_dp_attention(sglang_args: Sequence[str], overrides: Mapping[str, OverrideValue]) -> bool:
    """Whether SGLang serves an engine with attention data parallelism: `--enable-dp-attention`
    (deprecated spelling) or `--attn-dp-size` above 1 among the pass-through flags, with the
    engine group's `overrides` over them (false or null there removes a flag)."""
    flags: dict[str, str] = {}
    for i, token in enumerate(sglang_args):
        name, eq, value = token.removeprefix("--").partition("=")
        key = name.replace("_", "-")
        if token.startswith("--") and key in _DP_ATTENTION_FLAGS:
            following = sglang_args[i + 1] if i + 1 < len(sglang_args) else "--"
            flags[key] = value if eq else ("" if following.startswith("--") else following)
    for raw, given in overrides.items():
        key = raw.lstrip("-").replace("_", "-")
        if key not in _DP_ATTENTION_FLAGS:
            continue
        if given is False or given is None:
            flags.pop(key, None)
        else:
            flags[key] = str(given[0] if isinstance(given, list) and given else given)
    if "enable-dp-attention" in flags:
        return True
    size = flags.get("attn-dp-size")
    if size is None:
        return False
    try:
        return int(size) > 1
    except ValueError:
        return True  # SGLang refuses the value itself; keeping the ports costs nothing


def _engines(
    groups: list[ServerGroup],
    bundles: list[Bundle],
    nodes: list[PlanNode],
    kind: DeviceKind,
    ports: _Ports,
    cluster: ClusterConfig,
    sglang_args: Sequence[str],
) -> tuple[list[Engine], list[Reservation]]:
    engines: list[Engine] = []
    reserved: list[Reservation] = []
    cursor = 0
    for group in groups:
        span = bundles[cursor : cursor + group.num_gpus]
        cursor += group.num_gpus
        if group.worker_type == "placeholder":
            reserved.append(Reservation(group=group.name, bundles=span))
            continue
        size = group.num_gpus_per_engine or cluster.rollout_num_gpus_per_engine
        dp_attention = uses_dp_attention(sglang_args, group.overrides)
        for start in range(0, len(span), size):
            chunk = span[start : start + size]
            engines.append(
                _engine(len(engines), group, size, chunk, nodes, kind, ports, cluster, dp_attention)
            )
    return engines, reserved


def _engine(
    index: int,
    group: ServerGroup,
    size: int,
    chunk: list[Bundle],
    nodes: list[PlanNode],
    kind: DeviceKind,
    ports: _Ports,
    cluster: ClusterConfig,
    dp_attention: bool,
) -> Engine:
    by_node: dict[int, list[int]] = {}
    for bundle in chunk:
        by_node.setdefault(bundle.node, []).append(bundle.device)
    on = list(by_node)
    if len(on) > 1:
        counts = ", ".join(f"{len(devs)} on {nodes[n].hostname}" for n, devs in by_node.items())
        # slime's rule: an engine wider than a node spans nodes (SGLang's --nnodes); one that would fit
        # in a node but straddles two only with the flag.
        wider_than_a_node = size > max(len(nodes[n].devices) for n in on)
        if not (wider_than_a_node or cluster.rollout_engines_may_span_nodes):
            raise ConfigError(
                "--rollout-num-gpus-per-engine",
                size,
                f"engine {index} (group {group.name!r}) would span nodes ({counts}); "
                "pass --rollout-engines-may-span-nodes, or pick an engine size that divides each node's "
                "rollout devices",
            )
        if len({len(devs) for devs in by_node.values()}) > 1:
            raise ConfigError(
                "--rollout-num-gpus-per-engine",
                size,
                f"engine {index} (group {group.name!r}) would take unequal device counts per node ({counts}); "
                "an engine spanning nodes needs the same number on each",
            )
    head = nodes[on[0]]
    what = f"engine {index}"
    http_port = ports.take(on, f"{what} HTTP port")
    nccl_port = ports.take(on, f"{what} NCCL port")
    dist_port = ports.take(on, f"{what} dist-init port")
    # Taken right after the dist-init port, so they are its +1..+SPAN (the cursors of `on` agree).
    dp_ports = [
        ports.take(on, f"{what} dist-init port +{k} (SGLang attention DP)")
        for k in range(1, DP_ATTENTION_PORT_SPAN + 1)
        if dp_attention
    ]
    parts = []
    for rank, (n, devs) in enumerate(by_node.items()):
        visible, env = _device_env(kind, devs)
        parts.append(
            EnginePart(
                node=n,
                hostname=nodes[n].hostname,
                node_rank=rank,
                devices=devs,
                cuda_visible_devices=visible,
                env=env,
            )
        )
    return Engine(
        index=index,
        group=group.name,
        worker_type=group.worker_type,
        external=False,
        tp_size=size,
        host=head.address,
        http_port=http_port,
        address=host_port(head.address, http_port),
        nccl_port=nccl_port,
        dist_init_addr=host_port(head.address, dist_port),
        nnodes=len(on),
        parts=parts,
        weight_sync_rank_offset=None,
        overrides=dict(group.overrides),
        dp_attention_ports=dp_ports,
    )


def _external_engines(cluster: ClusterConfig) -> list[Engine]:
    engines = []
    for i, addr in enumerate(cluster.rollout_external_engine_addrs):
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
        engines.append(
            Engine(
                index=i,
                group="external",
                worker_type="regular",
                external=True,
                tp_size=cluster.rollout_num_gpus_per_engine,
                host=host,
                http_port=int(port),
                address=host_port(host, int(port)),
                nccl_port=None,
                dist_init_addr=None,
                nnodes=1,
                parts=[],
                weight_sync_rank_offset=None,
            )
        )
    return engines


def _with_sync_offsets(
    engines: list[Engine], actor: TrainGroup | None, nodes: list[PlanNode], ports: _Ports
) -> tuple[list[Engine], WeightSyncLayout | None]:
    if actor is None or not engines:
        return engines, None
    first = actor.nodes[0].node
    port = ports.take([first], "weight-sync group port")
    offset = 1  # group rank 0 is the trainer's rank 0
    ranks, placed = [], []
    for engine in engines:
        ranks.append(EngineSyncRanks(engine=engine.index, rank_offset=offset, size=engine.tp_size))
        placed.append(msgspec.structs.replace(engine, weight_sync_rank_offset=offset))
        offset += engine.tp_size
    layout = WeightSyncLayout(
        world_size=offset, master_addr=nodes[first].address, master_port=port, engines=ranks
    )
    return placed, layout


def plan_from_config(
    cluster: ClusterConfig,
    debug_rollout_only: bool,
    debug_train_only: bool,
    inventory: Inventory,
    resolve: Callable[[str], str | None] = resolve_host,
    *,
    use_critic: bool = False,
    sglang_args: Sequence[str] = (),
) -> Plan:
    """The placement plan for these flags on this inventory; impossible requests raise ConfigError.

    `use_critic` (--advantage-estimator ppo): a critic group, by default on the actor's devices
    with the actor's shape (slime's layout); --critic-num-nodes and friends reshape it.
    `sglang_args`: the `--sglang-*` pass-through flags (without the prefix); with attention data
    parallelism the engines' ports leave room for what SGLang binds beside them."""
    mode = _mode(cluster, debug_rollout_only, debug_train_only)
    kind: DeviceKind = "cpu" if cluster.cpu_devices is not None else "gpu"
    nodes = _plan_nodes(inventory, cluster, resolve)
    devices = _Devices(nodes)
    ports = _Ports(nodes, cluster.node_port_first, cluster.node_port_last)
    train_groups: list[TrainGroup] = []
    actor: TrainGroup | None = None
    if mode != "debug-rollout-only":
        if cluster.actor_num_nodes == 0 or cluster.actor_num_gpus_per_node == 0:
            raise ConfigError(
                "--actor-num-nodes" if cluster.actor_num_nodes == 0 else "--actor-num-gpus-per-node",
                0,
                "a run with a trainer needs at least one actor node with one device",
            )
        slices = devices.take_group(
            "actor", "--actor-num-nodes", cluster.actor_num_nodes, cluster.actor_num_gpus_per_node
        )
        actor = _train_group("actor", slices, nodes, kind, ports)
        train_groups.append(actor)
        if cluster.critic_num_nodes is not None or use_critic:
            train_groups.append(_critic_group(cluster, devices, slices, nodes, kind, ports))
        if cluster.ref_num_nodes is not None:
            per_node = cluster.ref_num_gpus_per_node or cluster.actor_num_gpus_per_node
            ref = devices.take_group("reference group", "--ref-num-nodes", cluster.ref_num_nodes, per_node)
            train_groups.append(_train_group("reference", ref, nodes, kind, ports))

    engines: list[Engine] = []
    reserved: list[Reservation] = []
    if mode == "external" or (mode == "debug-rollout-only" and cluster.uses_external_engines):
        engines = _external_engines(cluster)
    elif mode != "debug-train-only":
        rollout_gpus = cluster.rollout_num_gpus
        if rollout_gpus is None and cluster.sglang_config is None:
            rollout_gpus = actor.world_size if mode == "colocated" and actor else len(devices.free_bundles())
            if rollout_gpus == 0:
                raise ConfigError(
                    "--rollout-num-gpus",
                    None,
                    f"no devices left for rollout: trainer groups take all {devices.total()}; "
                    "set --rollout-num-gpus, --colocate or --debug-train-only",
                )
        groups = _server_groups(cluster, rollout_gpus)
        bundles = _rollout_bundles(mode, cluster, devices, actor, groups)
        engines, reserved = _engines(groups, bundles, nodes, kind, ports, cluster, sglang_args)
    engines, layout = _with_sync_offsets(engines, actor, nodes, ports)
    return Plan(
        format_version=PLAN_FORMAT_VERSION,
        device_kind=kind,
        mode=mode,
        colocate=cluster.colocate,
        offload_train=cluster.offloads_train,
        offload_rollout=cluster.offloads_rollout,
        nodes=nodes,
        train_groups=train_groups,
        engines=engines,
        reserved=reserved,
        weight_sync=layout,
    )


def _critic_group(
    cluster: ClusterConfig,
    devices: _Devices,
    actor_slices: list[list[Bundle]],
    nodes: list[PlanNode],
    kind: DeviceKind,
    ports: _Ports,
) -> TrainGroup:
    # slime's default: as many nodes and devices as the actor.
    num_nodes = cluster.critic_num_nodes or len(actor_slices)
    per_node = cluster.critic_num_gpus_per_node or cluster.actor_num_gpus_per_node
    if cluster.critic_separate_gpus:
        slices = devices.take_group("critic", "--critic-num-nodes", num_nodes, per_node)
        return _train_group("critic", slices, nodes, kind, ports)
    # slime's layout: the critic's ranks share the actor's devices (one process each per device).
    if num_nodes > len(actor_slices) or per_node > len(actor_slices[0]):
        raise ConfigError(
            "--critic-num-nodes",
            num_nodes,
            f"a critic sharing the actor's devices must fit in them: critic {num_nodes} x {per_node}, "
            f"actor {len(actor_slices)} x {len(actor_slices[0])}; or pass --critic-separate-gpus",
        )
    slices = [bundles[:per_node] for bundles in actor_slices[:num_nodes]]
    return _train_group("critic", slices, nodes, kind, ports, shares="actor")

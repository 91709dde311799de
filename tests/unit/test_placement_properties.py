"""Property tests over random clusters: determinism, no double use, engines within nodes, rank order."""

from __future__ import annotations

import random

import msgspec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.runtime.errors import ConfigError


@st.composite
def clusters(draw: st.DrawFn) -> Inventory:
    count = draw(st.integers(1, 4))
    octets = draw(st.lists(st.integers(1, 254), min_size=count, max_size=count, unique=True))
    nodes = []
    for i, octet in enumerate(octets):
        indices = draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
        nodes.append(
            Node(hostname=f"h{i}", address=f"10.0.{octet % 3}.{octet}", gpus=[Gpu(index=g) for g in indices])
        )
    return Inventory(nodes=nodes)


@st.composite
def configs(draw: st.DrawFn) -> tuple[ClusterConfig, bool, bool]:
    flags = {
        "actor_num_nodes": draw(st.integers(1, 3)),
        "actor_num_gpus_per_node": draw(st.integers(1, 8)),
        "rollout_num_gpus": draw(st.none() | st.integers(0, 16)),
        "rollout_num_gpus_per_engine": draw(st.sampled_from([1, 2, 4, 8])),
        "colocate": draw(st.booleans()),
        "rollout_engines_may_span_nodes": draw(st.booleans()),
    }
    mode = draw(st.sampled_from(["normal", "normal", "rollout-only", "train-only"]))
    return msgspec.convert(flags, ClusterConfig), mode == "rollout-only", mode == "train-only"


def shuffled(inventory: Inventory, seed: int) -> Inventory:
    rng = random.Random(seed)
    nodes = [Node(n.hostname, n.address, rng.sample(n.gpus, len(n.gpus))) for n in inventory.nodes]
    rng.shuffle(nodes)
    return Inventory(nodes=nodes)


def try_plan(config: tuple[ClusterConfig, bool, bool], inventory: Inventory) -> Plan | None:
    cluster, rollout_only, train_only = config
    try:
        return plan_from_config(cluster, rollout_only, train_only, inventory, resolve=lambda name: None)
    except ConfigError:
        return None


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(clusters(), configs(), st.integers(0, 2**32))
def test_the_same_cluster_in_any_discovery_order_gives_the_same_plan(
    inventory: Inventory, config: tuple[ClusterConfig, bool, bool], seed: int
) -> None:
    first = try_plan(config, inventory)
    again = try_plan(config, shuffled(inventory, seed))
    assert (first is None) == (again is None)
    assume(first is not None)
    assert first is not None and again is not None
    assert first.to_json() == again.to_json()
    assert msgspec.json.decode(first.to_json(), type=Plan) == first


@SETTINGS
@given(clusters(), configs())
def test_devices_ports_and_ranks_are_consistent(
    inventory: Inventory, config: tuple[ClusterConfig, bool, bool]
) -> None:
    plan = try_plan(config, inventory)
    assume(plan is not None)
    assert plan is not None
    cluster = config[0]

    # No device used twice, except an engine on the actor's devices under --colocate.
    actor_devices = {(n.node, d) for g in plan.train_groups for n in g.nodes for d in n.devices}
    engine_devices = [(p.node, d) for e in plan.engines for p in e.parts for d in p.devices]
    engine_devices += [(b.node, b.device) for r in plan.reserved for b in r.bundles]
    assert len(engine_devices) == len(set(engine_devices))
    trainer_devices = [(n.node, d) for g in plan.train_groups for n in g.nodes for d in n.devices]
    assert len(trainer_devices) == len(set(trainer_devices))
    if not plan.colocate:
        assert not actor_devices & set(engine_devices)
    for node, device in engine_devices + trainer_devices:
        assert device in plan.nodes[node].devices

    # Every engine inside one node unless wider than a node or spanning was asked for; spanning
    # parts have equal sizes.
    for engine in plan.engines:
        assert len(engine.parts) == engine.nnodes
        assert sum(len(p.devices) for p in engine.parts) == engine.tp_size
        if not cluster.rollout_engines_may_span_nodes and engine.nnodes > 1:  # slime's rule only
            assert all(engine.tp_size > len(plan.nodes[p.node].devices) for p in engine.parts)
        assert len({len(p.devices) for p in engine.parts}) == 1

    # Ranks follow the sorted order: nodes ascending by address, devices ascending within a node.
    for group in plan.train_groups:
        assert [n.node for n in group.nodes] == sorted(n.node for n in group.nodes)
        assert [n.node_rank for n in group.nodes] == list(range(group.nnodes))
        assert [n.first_rank for n in group.nodes] == [r * group.nproc_per_node for r in range(group.nnodes)]
        for launch in group.nodes:
            assert launch.devices == sorted(launch.devices)
    flat = [(p.node, d) for e in plan.engines for p in e.parts for d in p.devices]
    if not plan.colocate:
        assert flat == sorted(flat)
    keys = [tuple(int(x) for x in n.address.split(".")) for n in plan.nodes]
    assert keys == sorted(keys)

    # Ports: never handed out twice on one node, all inside the range.
    used: set[tuple[int, int]] = set()
    for group in plan.train_groups:
        port = int(group.rdzv_endpoint.rsplit(":", 1)[1])
        assert (group.nodes[0].node, port) not in used
        used.add((group.nodes[0].node, port))
    for engine in plan.engines:
        assert engine.nccl_port is not None and engine.dist_init_addr is not None
        for port in (engine.http_port, engine.nccl_port, int(engine.dist_init_addr.rsplit(":", 1)[1])):
            assert cluster.node_port_first <= port <= cluster.node_port_last
            for part in engine.parts:
                assert (part.node, port) not in used
                used.add((part.node, port))

    # The weight-sync group: trainer rank 0, then each engine's ranks back to back.
    if plan.weight_sync is not None:
        assert (plan.train_groups[0].nodes[0].node, plan.weight_sync.master_port) not in used
        offsets = [s.rank_offset for s in plan.weight_sync.engines]
        sizes = [s.size for s in plan.weight_sync.engines]
        assert offsets == [1 + sum(sizes[:i]) for i in range(len(sizes))]
        assert plan.weight_sync.world_size == 1 + sum(sizes)

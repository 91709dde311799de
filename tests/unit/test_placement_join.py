"""A node that joins a running run: its engines placed after the plan's, by the same rules."""

from __future__ import annotations

import msgspec
import pytest

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.join import JOINED_GROUP, place_joined, plan_ports
from tether.placement.plan import Plan, plan_from_config
from tether.runtime.errors import ConfigError


def gpu_plan(**flags: object) -> tuple[Plan, ClusterConfig]:
    inventory = Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(4)])
            for i in range(2)
        ]
    )
    cluster = msgspec.convert(
        {"actor_num_nodes": 1, "actor_num_gpus_per_node": 4, "node_port_first": 20000, **flags}, ClusterConfig
    )
    return plan_from_config(cluster, False, False, inventory, resolve=lambda name: None), cluster


def test_joined_engines_follow_the_plan_in_sorted_device_order() -> None:
    plan, cluster = gpu_plan(rollout_num_gpus_per_engine=2)
    assert [e.index for e in plan.engines] == [0, 1]
    node, engines = place_joined(plan, cluster, hostname="n9", address="10.0.0.9", devices=[3, 1, 2, 0])
    assert (node.index, node.hostname, node.devices) == (2, "n9", [0, 1, 2, 3])
    assert [e.index for e in engines] == [2, 3]
    assert [(e.parts[0].node, e.parts[0].devices) for e in engines] == [(2, [0, 1]), (2, [2, 3])]
    assert all(e.group == JOINED_GROUP and e.worker_type == "regular" and e.tp_size == 2 for e in engines)
    assert engines[0].parts[0].cuda_visible_devices == "0,1"
    # A new machine: its ports start at the range's first, one block per engine as at start.
    assert (engines[0].host, engines[0].http_port) == ("10.0.0.9", 20000)
    assert engines[1].http_port == engines[0].http_port + 3
    # The same inputs place the same way (deterministic).
    assert place_joined(plan, cluster, hostname="n9", address="10.0.0.9", devices=[0, 1, 2, 3])[1] == engines


def test_a_second_join_comes_after_the_first_and_shares_no_port_on_one_machine() -> None:
    plan, cluster = gpu_plan(rollout_num_gpus_per_engine=4)
    first, engines = place_joined(plan, cluster, hostname="x", address="10.0.0.2", devices=[0, 1, 2, 3])
    taken = max(plan_ports(plan).values())
    assert engines[0].http_port > taken  # on node n1's machine: past every port the run uses there
    second, more = place_joined(
        plan,
        cluster,
        hostname="y",
        address="10.0.0.2",
        devices=[4, 5, 6, 7],
        joined=[first],
        joined_engines=engines,
    )
    assert (first.index, second.index) == (2, 3)
    assert [e.index for e in more] == [engines[-1].index + 1]
    assert more[0].http_port > max(engines[0].http_port, engines[0].nccl_port or 0)


def test_a_node_that_cannot_hold_an_engine_or_names_no_gpus_is_refused() -> None:
    plan, cluster = gpu_plan(rollout_num_gpus_per_engine=4)
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus-per-engine.*not enough for one engine"):
        place_joined(plan, cluster, hostname="x", address="10.0.0.9", devices=[0, 1])
    with pytest.raises(ConfigError, match="--devices"):
        place_joined(plan, cluster, hostname="x", address="10.0.0.9", devices=None)


def test_a_cpu_run_offers_its_slots_by_default() -> None:
    inventory = Inventory(nodes=[Node(hostname="a", address="10.0.0.1")])
    cluster = msgspec.convert(
        {"cpu_devices": 2, "actor_num_nodes": 1, "actor_num_gpus_per_node": 1}, ClusterConfig
    )
    plan = plan_from_config(cluster, False, False, inventory, resolve=lambda name: None)
    node, engines = place_joined(plan, cluster, hostname="c", address="10.0.0.3", devices=None)
    assert node.devices == [0, 1] and [e.parts[0].devices for e in engines] == [[0], [1]]
    assert engines[0].parts[0].env == {"CUDA_VISIBLE_DEVICES": ""}

"""The head's bind address against the plan: the head node's address on several machines,
loopback on one, and a loopback bind refused when nodes are elsewhere."""

from __future__ import annotations

import pytest

from tether.config import resolve
from tether.placement.inventory import Inventory, Node
from tether.placement.plan import plan_from_config
from tether.run.job import head_bind_host
from tether.run.nodes.names import node_names
from tether.runtime.errors import ConfigError


def plan_on(*addresses: str):  # type: ignore[no-untyped-def]
    cfg = resolve(
        ["--cpu-devices", "1", "--actor-num-nodes", str(len(addresses)), "--actor-num-gpus-per-node", "1"]
    )
    nodes = [Node(hostname=f"node{i}", address=a, gpus=[]) for i, a in enumerate(addresses)]
    plan = plan_from_config(cfg.cluster, True, False, Inventory(nodes=nodes))
    return cfg, plan, node_names(plan, this_host="node0")


def test_multi_node_default_binds_the_head_nodes_address() -> None:
    cfg, plan, names = plan_on("10.9.0.1", "10.9.0.2")
    assert head_bind_host(cfg, plan, names) == "10.9.0.1"


def test_loopback_bind_with_nodes_on_other_machines_is_refused() -> None:
    cfg, plan, names = plan_on("10.9.0.1", "10.9.0.2")
    cfg = resolve(["--cpu-devices", "1", "--head-bind-host", "127.0.0.1"])
    with pytest.raises(ConfigError, match=r"--head-bind-host=.*127\.0\.0\.1.*node1.*10\.9\.0\.1"):
        head_bind_host(cfg, plan, names)


def test_one_machine_binds_loopback() -> None:
    cfg, plan, names = plan_on("127.0.0.1", "127.0.0.2")  # both "nodes" on this machine
    assert head_bind_host(cfg, plan, names) == "127.0.0.1"

"""The head moves a plan's port block past ports already taken on this machine (heads in
several processes claiming at once: tests/integration/test_head_port_claims.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from support.plans import ONE_BOX, one_box_plan

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Inventory, Node
from tether.placement.plan import plan_from_config
from tether.run.nodes.ports import PortClaims, local_ports, machine_addresses, plan_with_free_ports, port_free
from tether.runtime.errors import ConfigError

CLUSTER = ONE_BOX
make = one_box_plan


def test_free_block_is_used_as_planned() -> None:
    plan = plan_with_free_ports(CLUSTER, make, is_free=lambda host, port: True)
    assert min(p for _, p in local_ports(plan)) == 20000


def test_taken_port_moves_the_whole_block() -> None:
    taken = {("127.0.0.1", 20001)}  # say another run's engine
    plan = plan_with_free_ports(CLUSTER, make, is_free=lambda host, port: (host, port) not in taken)
    ports = [p for _, p in local_ports(plan)]
    assert min(ports) > 20001 and not taken & set(local_ports(plan))
    assert len(ports) == len(local_ports(make(CLUSTER)))  # the same plan, shifted


def test_no_free_block_names_the_range() -> None:
    narrow = ClusterConfig(
        cpu_devices=3,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=1,
        node_port_first=20000,
        node_port_last=20006,
    )
    with pytest.raises(ConfigError, match="--node-port-first"):
        plan_with_free_ports(narrow, make, is_free=lambda host, port: port != 20004)


def test_port_free_sees_a_bound_socket() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_free("127.0.0.1", sock.getsockname()[1])


def test_a_claim_lasts_until_released_or_its_holder_ends(tmp_path: Path) -> None:
    first = PortClaims(tmp_path)
    plan = plan_with_free_ports(CLUSTER, make, claims=first, here={"127.0.0.1"})
    held = [p for _, p in local_ports(plan)]
    assert first.ports == sorted(held)
    second = PortClaims(tmp_path)
    moved = plan_with_free_ports(CLUSTER, make, claims=second, here={"127.0.0.1"})
    assert not set(p for _, p in local_ports(moved)) & set(held)
    first.release()
    assert all(second.claim(p) for p in held)  # free again once released
    second.release()


def test_the_heads_own_node_address_is_checked() -> None:
    """A plan whose node is this machine's non-loopback address is checked there too."""
    addresses = machine_addresses()
    assert "127.0.0.1" in addresses
    inventory = Inventory(nodes=[Node(hostname="box", address="10.99.0.1", gpus=[])])
    plan = plan_from_config(CLUSTER, False, False, inventory)
    assert local_ports(plan, {"10.99.0.1"}) and not local_ports(plan, {"127.0.0.1"})

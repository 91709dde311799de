"""Golden plans: the JSON of known layouts must not change unnoticed.

Regenerate after an intended change with `TETHER_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_placement_golden.py`
and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node, apply_visibility, discover_inventory
from tether.placement.plan import Plan, plan_from_config

GOLDEN = Path(__file__).parent / "golden" / "placement"


def cluster_of(nodes: int, gpus: int) -> Inventory:
    return Inventory(
        nodes=[
            Node(
                hostname=f"node{i:02d}",
                address=f"192.168.1.{10 + i}",
                gpus=[Gpu(index=g, uuid=f"GPU-{i:02d}{g:02d}") for g in range(gpus)],
            )
            for i in reversed(range(nodes))  # discovery order is not rank order
        ]
    )


def slurm_inventory() -> Inventory:
    gpus = [Gpu(index=g, uuid=f"GPU-08{g:02d}", pci_bus_id=f"00000000:{0x10 + g:02X}:00.0") for g in range(8)]

    def local(cluster: ClusterConfig, env: Mapping[str, str]) -> Node:
        return Node(hostname="gpu08", address="10.1.0.8", gpus=apply_visibility(gpus, env))

    env = {"SLURM_JOB_NODELIST": "gpu[07-08,10]", "CUDA_VISIBLE_DEVICES": "2,3,4,5"}
    addresses = {"gpu07": "10.1.0.7", "gpu10": "10.1.0.10"}
    return discover_inventory(ClusterConfig(), env=env, local=local, resolve=addresses.get)


def build(name: str) -> Plan:
    match name:
        case "1x8":
            cluster = ClusterConfig(
                actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2
            )
            inventory = cluster_of(1, 8)
        case "2x8_decoupled":
            cluster = ClusterConfig(
                actor_num_gpus_per_node=8, rollout_num_gpus=8, rollout_num_gpus_per_engine=4
            )
            inventory = cluster_of(2, 8)
        case "4x8_colocated":
            cluster = ClusterConfig(actor_num_nodes=4, colocate=True, rollout_num_gpus_per_engine=8)
            inventory = cluster_of(4, 8)
        case "server_groups_placeholder":
            cluster = ClusterConfig(
                actor_num_gpus_per_node=8,
                rollout_num_gpus=8,
                rollout_num_gpus_per_engine=2,
                sglang_config=str(GOLDEN / "server_groups.yaml"),
            )
            inventory = cluster_of(2, 8)
        case "slurm_visible_subset":
            cluster = ClusterConfig(
                actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus_per_engine=2
            )
            inventory = slurm_inventory()
        case _:
            raise AssertionError(name)
    return plan_from_config(cluster, False, False, inventory, resolve=lambda host: None)


CASES = ["1x8", "2x8_decoupled", "4x8_colocated", "server_groups_placeholder", "slurm_visible_subset"]


@pytest.mark.parametrize("name", CASES)
def test_plan_matches_golden(name: str) -> None:
    plan = build(name)
    text = msgspec.json.format(plan.to_json(), indent=2).decode() + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("TETHER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with TETHER_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text()

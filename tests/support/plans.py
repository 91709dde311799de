"""Placement plans and engine launch configs that several tests build (building them starts nothing)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.rollout.engine_api.launch import EngineLaunchConfig

PY = "/opt/sglang/bin/python"
"""An SGLang python that need not exist: the argv is built, not run."""


def sglang_cfg(**fields: object) -> EngineLaunchConfig:
    values: dict[str, object] = {"model_path": "/models/m", "sglang_python": PY, "device_kind": "gpu"}
    values.update(fields)
    return msgspec.convert(values, EngineLaunchConfig)


def gpu_plan(tmp_path: Path, **flags: object) -> Plan:
    """A plan on two nodes of four GPUs each, from `ClusterConfig` fields."""
    inventory = Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(4)])
            for i in range(2)
        ]
    )
    cluster = msgspec.convert(flags, ClusterConfig)
    return plan_from_config(cluster, True, False, inventory, resolve=lambda name: None)


ONE_BOX = ClusterConfig(cpu_devices=3, actor_num_gpus_per_node=2, rollout_num_gpus=1, node_port_first=20000)
"""A run on one machine (127.0.0.1) whose port block starts at 20000 (the head-port tests')."""


def one_box_plan(cluster: ClusterConfig) -> Plan:
    """`cluster` placed on one CPU machine at 127.0.0.1 (the `make` that plan_with_free_ports takes)."""
    inventory = Inventory(nodes=[Node(hostname="box", address="127.0.0.1", gpus=[])])
    return plan_from_config(cluster, False, False, inventory)

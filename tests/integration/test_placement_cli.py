"""`tether plan` as a real process: JSON equal to the library's plan, readable tables, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node, load_inventory
from tether.placement.plan import Plan, plan_from_config


def tether(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tether", "plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def write_inventory(tmp_path: Path) -> Path:
    inventory = Inventory(
        nodes=[
            Node(hostname="beta", address="10.0.0.20", gpus=[Gpu(index=i) for i in (3, 2, 1, 0)]),
            Node(hostname="alpha", address="10.0.0.3", gpus=[Gpu(index=i) for i in range(4)]),
        ]
    )
    path = tmp_path / "inventory.json"
    path.write_bytes(msgspec.json.encode(inventory))
    return path


def test_json_output_is_the_library_plan(tmp_path: Path) -> None:
    path = write_inventory(tmp_path)
    done = tether(
        "--inventory",
        str(path),
        "--actor-num-gpus-per-node",
        "4",
        "--rollout-num-gpus-per-engine",
        "2",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    printed = msgspec.json.decode(done.stdout, type=Plan)
    cluster = ClusterConfig(inventory=str(path), actor_num_gpus_per_node=4, rollout_num_gpus_per_engine=2)
    assert printed == plan_from_config(cluster, False, False, load_inventory(path))
    assert [n.hostname for n in printed.nodes] == ["alpha", "beta"]


def test_table_output_and_cpu_devices(tmp_path: Path) -> None:
    path = write_inventory(tmp_path)
    done = tether(
        "--inventory",
        str(path),
        "--cpu-devices",
        "2",
        "--actor-num-gpus-per-node",
        "2",
        "--debug-rollout-only",
    )
    assert done.returncode == 0, done.stderr
    assert "mode debug-rollout-only" in done.stdout and "cpu devices" in done.stdout
    assert "alpha" in done.stdout and "10.0.0.20:20000" in done.stdout


def test_bad_flags_exit_2_naming_the_flag(tmp_path: Path) -> None:
    path = write_inventory(tmp_path)
    done = tether("--inventory", str(path), "--actor-num-nodes", "3")
    assert done.returncode == 2 and "--actor-num-nodes=3" in done.stderr and "needs 3 node(s)" in done.stderr
    done = tether("--inventory", str(path), "--rollout-num-gpus-per-engine", "0")
    assert done.returncode == 2 and "--rollout-num-gpus-per-engine" in done.stderr and ">= 1" in done.stderr
    done = tether("--inventory", str(path), "--node-port-first", "3000", "--node-port-last", "2000")
    assert (
        done.returncode == 2
        and "tether plan: --node-port-last=2000: is below --node-port-first=3000" in done.stderr
    )
    done = tether("--inventory", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "--inventory=" in done.stderr and "cannot be read" in done.stderr

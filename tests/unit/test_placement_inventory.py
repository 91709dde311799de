"""Inventory discovery: SLURM node lists, GPU binding variables, nvidia-smi rows, declared inventories
(this machine's own GPUs, read by running nvidia-smi: tests/integration/test_placement_local_gpus.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest

from tether.placement.config import ClusterConfig
from tether.placement.inventory import (
    Gpu,
    Inventory,
    Node,
    apply_visibility,
    discover_inventory,
    expand_nodelist,
    load_inventory,
    parse_nvidia_smi,
    read_gpus_nvml,
    route_source_address,
)
from tether.runtime.errors import ConfigError

EIGHT = [Gpu(index=i, uuid=f"GPU-{i:02d}aa-{i}", pci_bus_id=f"00000000:{i + 10:02X}:00.0") for i in range(8)]


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("n[1-2],login5", ["n1", "n2", "login5"]),
        ("rack[1-2]n[001-002]", ["rack1n001", "rack1n002", "rack2n001", "rack2n002"]),
        ("single", ["single"]),
    ],
)
def test_slurm_nodelists_expand_with_zero_padding_kept(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


def test_a_broken_nodelist_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_nodelist("node[01-")


def test_nvidia_smi_rows_parse_with_and_without_units() -> None:
    text = "0, GPU-abc, 00000000:07:00.0, 81559 MiB\n1, GPU-def, 00000000:0A:00.0, 81559\n\n"
    assert parse_nvidia_smi(text) == [
        Gpu(index=0, uuid="GPU-abc", pci_bus_id="00000000:07:00.0", memory_mib=81559),
        Gpu(index=1, uuid="GPU-def", pci_bus_id="00000000:0A:00.0", memory_mib=81559),
    ]
    with pytest.raises(ValueError, match="unexpected row"):
        parse_nvidia_smi("No devices were found")


@pytest.mark.parametrize(
    ("env", "indices"),
    [
        ({}, list(range(8))),
        ({"CUDA_VISIBLE_DEVICES": "5,2"}, [2, 5]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-03aa-3,GPU-06aa-6"}, [3, 6]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-04"}, [4]),  # a unique UUID prefix, as CUDA accepts
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"SLURM_STEP_GPUS": "1,3", "SLURM_JOB_GPUS": "0,1,2,3"}, [1, 3]),
        ({"SLURM_JOB_GPUS": "6,7"}, [6, 7]),
        ({"GPU_DEVICE_ORDINAL": "0"}, [0]),
        ({"CUDA_VISIBLE_DEVICES": "7", "SLURM_JOB_GPUS": "0,1"}, [7]),
    ],
)
def test_binding_variables_select_gpus_by_index_or_uuid(env: Mapping[str, str], indices: list[int]) -> None:
    assert [gpu.index for gpu in apply_visibility(EIGHT, env)] == indices


def test_binding_to_a_missing_gpu_names_the_variable_and_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='1,9'.*GPU 9"):
        apply_visibility(EIGHT, {"CUDA_VISIBLE_DEVICES": "1,9"})
    with pytest.raises(ConfigError, match="matches 8 GPUs"):
        apply_visibility(EIGHT, {"CUDA_VISIBLE_DEVICES": "GPU-0"})


def test_declared_inventory_loads_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    good = Inventory(nodes=[Node(hostname="a", address="10.0.0.1", gpus=[Gpu(index=0, uuid="GPU-x")])])
    path = tmp_path / "inv.json"
    path.write_bytes(msgspec.json.encode(good))
    assert load_inventory(path) == good

    path.write_text('{"nodes": [{"hostname": "a", "address": "10.0.0.1", "gpus": [{"index": "zero"}]}]}')
    with pytest.raises(ConfigError, match=r"--inventory=.*\$\.nodes\[0\]\.gpus\[0\]\.index"):
        load_inventory(path)
    path.write_text('{"nodes": [')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_inventory(path)
    path.write_text('{"nodes": [{"hostname": "a", "address": "h"}, {"hostname": "b", "address": "h"}]}')
    with pytest.raises(ConfigError, match=r"inventory.nodes\[1\].address='h': duplicates"):
        load_inventory(path)
    path.write_text('{"nodes": [{"hostname": "a", "address": "h", "gpus": [{"index": 1}, {"index": 1}]}]}')
    with pytest.raises(ConfigError, match="lists a GPU index twice"):
        load_inventory(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_inventory(tmp_path / "missing.json")


def test_slurm_discovery_expands_nodes_and_copies_the_local_binding() -> None:
    def local(cluster: ClusterConfig, env: Mapping[str, str]) -> Node:
        return Node(hostname="gpu08", address="10.1.0.8", gpus=apply_visibility(EIGHT, env))

    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    addresses = {"gpu07": "10.1.0.7"}
    inventory = discover_inventory(ClusterConfig(), env=env, local=local, resolve=addresses.get)
    assert [(n.hostname, n.address) for n in inventory.nodes] == [
        ("gpu07", "10.1.0.7"),
        ("gpu08", "10.1.0.8"),
    ]
    assert [[g.index for g in n.gpus] for n in inventory.nodes] == [[4, 5, 6, 7], [4, 5, 6, 7]]


def test_own_name_resolving_to_loopback_takes_the_address_on_the_route_to_the_others() -> None:
    """Debian resolves a machine's own name to 127.0.1.1; other nodes cannot reach that."""

    def local(cluster: ClusterConfig, env: Mapping[str, str]) -> Node:
        return Node(hostname="gpu08", address="127.0.1.1")

    env = {"SLURM_JOB_NODELIST": "gpu[07-08]"}
    routes = {"10.1.0.7": "10.1.0.8"}
    inventory = discover_inventory(
        ClusterConfig(), env=env, local=local, resolve={"gpu07": "10.1.0.7"}.get, route=routes.get
    )
    assert [n.address for n in inventory.nodes] == ["10.1.0.7", "10.1.0.8"]
    # --head-network-interface names the address itself; a one-machine job stays on loopback.
    named = discover_inventory(
        ClusterConfig(head_network_interface="lo"),
        env=env,
        local=local,
        resolve={"gpu07": "10.1.0.7"}.get,
        route=routes.get,
    )
    assert named.nodes[1].address == "127.0.1.1"
    alone = discover_inventory(
        ClusterConfig(), env={"SLURM_JOB_NODELIST": "gpu08"}, local=local, route=routes.get
    )
    assert alone.nodes[0].address == "127.0.1.1"
    assert route_source_address("127.0.0.1") == "127.0.0.1"


def test_discovery_without_slurm_is_this_node_and_inventory_flag_wins(tmp_path: Path) -> None:
    here = Node(hostname="box", address="127.0.0.1", gpus=EIGHT[:2])
    inventory = discover_inventory(ClusterConfig(), env={}, local=lambda c, e: here)
    assert inventory.nodes == [here]
    declared = Inventory(nodes=[Node(hostname="x", address="10.9.9.9")])
    path = tmp_path / "inv.json"
    path.write_bytes(msgspec.json.encode(declared))
    assert discover_inventory(ClusterConfig(inventory=str(path)), env={}, local=lambda c, e: here) == declared


def test_head_outside_the_job_assumes_num_gpus_per_node() -> None:
    here = Node(hostname="login", address="10.0.0.1")
    env = {"SLURM_JOB_NODELIST": "c[1-2]"}
    inventory = discover_inventory(
        ClusterConfig(num_gpus_per_node=4), env=env, local=lambda c, e: here, resolve=lambda n: None
    )
    assert [(n.address, len(n.gpus)) for n in inventory.nodes] == [("c1", 4), ("c2", 4)]


class _FakeNvml(types.ModuleType):
    """Stands in for pynvml on this GPU-less machine: two GPUs, bytes and str returns mixed as versions do."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return b"GPU-b0" if handle == 0 else "GPU-b1"

    def nvmlDeviceGetPciInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=f"00000000:{handle + 0x18:02X}:00.0".encode())

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=80 << 30)


def test_nvml_reading_converts_handles_to_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert read_gpus_nvml() == [
        Gpu(index=0, uuid="GPU-b0", pci_bus_id="00000000:18:00.0", memory_mib=80 * 1024),
        Gpu(index=1, uuid="GPU-b1", pci_bus_id="00000000:19:00.0", memory_mib=80 * 1024),
    ]
    assert fake.shut_down

"""Placement plans: the modes, server groups, spanning, trainer groups, and the errors impossible requests give."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.placement.server_groups import load_server_groups
from tether.placement.sorter import node_key, sort_nodes
from tether.runtime.errors import ConfigError


def cluster_of(nodes: int, gpus: int) -> Inventory:
    return Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(gpus)])
            for i in range(nodes)
        ]
    )


def plan(
    inventory: Inventory, debug_rollout_only: bool = False, debug_train_only: bool = False, **flags: object
) -> Plan:
    cluster = msgspec.convert(flags, ClusterConfig)
    return plan_from_config(
        cluster, debug_rollout_only, debug_train_only, inventory, resolve=lambda name: None
    )


def test_ipv4_sorts_numerically_then_ipv6_then_names() -> None:
    resolve = {"known": "10.0.0.5"}.get
    keys = sorted(
        ["zeta", "10.0.0.10", "fe80::1", "::2", "10.0.0.9", "known", "alpha"],
        key=lambda a: node_key(a, resolve),
    )
    assert keys == ["known", "10.0.0.9", "10.0.0.10", "::2", "fe80::1", "alpha", "zeta"]
    nodes = sort_nodes([Node("b", "10.0.0.2", [Gpu(3), Gpu(1)]), Node("a", "10.0.0.1")], resolve)
    assert [n.hostname for n in nodes] == ["a", "b"]
    assert [g.index for g in nodes[1].gpus] == [1, 3]


def test_decoupled_puts_actor_first_and_rollout_after() -> None:
    p = plan(cluster_of(2, 8), actor_num_nodes=1, actor_num_gpus_per_node=8, rollout_num_gpus_per_engine=2)
    assert p.mode == "decoupled"
    actor = p.train_group("actor")
    assert actor is not None and actor.world_size == 8 and actor.nodes[0].node == 0
    assert actor.nodes[0].cuda_visible_devices == "0,1,2,3,4,5,6,7"
    assert actor.nodes[0].env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert [(e.parts[0].node, e.parts[0].devices) for e in p.engines] == [
        (1, [0, 1]),
        (1, [2, 3]),
        (1, [4, 5]),
        (1, [6, 7]),
    ]
    assert p.weight_sync is not None and p.weight_sync.world_size == 9
    assert [e.weight_sync_rank_offset for e in p.engines] == [1, 3, 5, 7]
    assert actor.nodes[0].torchrun_args() == [
        "--nnodes=1",
        "--node-rank=0",
        "--nproc-per-node=8",
        "--master-addr=10.0.0.1",
        f"--master-port={actor.rdzv_endpoint.rsplit(':', 1)[1]}",
    ]
    engine = p.engines[0]
    assert engine.launch_args(engine.parts[0]) == [
        "--host", "10.0.0.2", "--port", str(engine.http_port), "--tp-size", "2",
        "--nccl-port", str(engine.nccl_port), "--dist-init-addr", str(engine.dist_init_addr),
    ]  # fmt: skip


def test_colocated_shares_the_actor_range_and_offloads() -> None:
    p = plan(cluster_of(1, 8), colocate=True, rollout_num_gpus_per_engine=4)
    assert p.mode == "colocated" and p.offload_train and p.offload_rollout
    assert [e.parts[0].devices for e in p.engines] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cpu_plan_uses_slots_without_cuda() -> None:
    p = plan(cluster_of(1, 0), cpu_devices=3, actor_num_gpus_per_node=1, rollout_num_gpus_per_engine=2)
    assert p.device_kind == "cpu"
    assert p.train_groups[0].nodes[0].cuda_visible_devices is None
    assert p.train_groups[0].nodes[0].env == {"CUDA_VISIBLE_DEVICES": ""}  # no GPU of the host
    assert p.engines[0].parts[0].devices == [1, 2]
    assert p.engines[0].parts[0].env == {"CUDA_VISIBLE_DEVICES": ""}


def test_no_gpu_without_cpu_devices_says_what_to_pass() -> None:
    with pytest.raises(ConfigError, match="--cpu-devices"):
        plan(cluster_of(2, 0))


def test_external_engines_take_no_devices() -> None:
    p = plan(
        cluster_of(1, 8),
        rollout_external=True,
        rollout_external_engine_addrs=["10.5.0.1:30000", "[fe80::1]:30001"],
        rollout_num_gpus_per_engine=4,
    )
    assert p.mode == "external"
    assert [(e.external, e.address, e.parts) for e in p.engines] == [
        (True, "10.5.0.1:30000", []),
        (True, "[fe80::1]:30001", []),
    ]
    assert p.weight_sync is not None and p.weight_sync.world_size == 9


def test_debug_modes() -> None:
    rollout_only = plan(cluster_of(1, 8), debug_rollout_only=True, rollout_num_gpus_per_engine=2)
    assert (
        rollout_only.train_groups == []
        and len(rollout_only.engines) == 4
        and rollout_only.weight_sync is None
    )
    assert rollout_only.engines[0].parts[0].devices == [0, 1]
    train_only = plan(cluster_of(1, 8), debug_train_only=True)
    assert (
        train_only.engines == [] and train_only.weight_sync is None and train_only.mode == "debug-train-only"
    )
    with pytest.raises(ConfigError, match="--debug-train-only"):
        plan(cluster_of(1, 8), debug_rollout_only=True, debug_train_only=True)


def test_an_engine_wider_than_a_node_spans_nodes_as_in_slime() -> None:
    # slime's rule: 16 GPUs per engine on 8-GPU nodes is an engine over two nodes, no flag needed.
    p = plan(cluster_of(2, 8), colocate=True, actor_num_nodes=2, rollout_num_gpus_per_engine=16)
    (engine,) = p.engines
    assert engine.nnodes == 2 and [part.node_rank for part in engine.parts] == [0, 1]
    assert engine.dist_init_addr is not None and engine.dist_init_addr.startswith("10.0.0.1:")
    assert engine.launch_args(engine.parts[1])[-4:] == ["--nnodes", "2", "--node-rank", "1"]
    # The same port numbers are bound on both nodes, so neither node hands them out again.
    actor = p.train_group("actor")
    assert actor is not None and actor.rdzv_endpoint.endswith(":20000") and engine.http_port == 20001
    # An engine that fits in a node but would straddle two still needs the flag.
    with pytest.raises(
        ConfigError, match=r"would span nodes \(2 on n0, 2 on n1\).*--rollout-engines-may-span"
    ):
        plan(cluster_of(2, 8), actor_num_gpus_per_node=6, rollout_num_gpus=4, rollout_num_gpus_per_engine=4)
    straddling = plan(
        cluster_of(2, 8),
        actor_num_gpus_per_node=6,
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=4,
        rollout_engines_may_span_nodes=True,
    )
    assert straddling.engines[0].nnodes == 2


def test_uneven_spanning_is_refused() -> None:
    with pytest.raises(ConfigError, match="unequal device counts"):
        plan(
            cluster_of(2, 8),
            actor_num_gpus_per_node=4,
            rollout_num_gpus=12,
            rollout_num_gpus_per_engine=6,
            rollout_engines_may_span_nodes=True,
        )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"actor_num_nodes": 3},
            r"--actor-num-nodes=3: the actor needs 3 node\(s\) x 8 devices \(24 in all\).*2 of 2",
        ),
        (
            {"actor_num_gpus_per_node": 4, "rollout_num_gpus": 13},
            r"--rollout-num-gpus=13: rollout needs 13 devices.*16, 4 of them taken.*12 free",
        ),
        (
            {"rollout_num_gpus": 6, "rollout_num_gpus_per_engine": 4},
            r"--rollout-num-gpus-per-engine=4: does not divide --rollout-num-gpus=6 \(2 devices left over\)",
        ),
        (
            {"actor_num_gpus_per_node": 6, "rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 4},
            r"would span nodes \(2 on n0, 2 on n1\)",
        ),
        (
            {"node_port_first": 20000, "node_port_last": 20002, "rollout_num_gpus": 8},
            r"--node-port-last=20002: port range 20000-20002 \(3 ports\) on n1 is exhausted",
        ),
        (
            {"actor_num_nodes": 2, "actor_num_gpus_per_node": 8},
            r"no devices left for rollout: trainer groups take all 16",
        ),
        ({"critic_num_nodes": 2}, r"--critic-num-nodes=2: a critic sharing the actor's devices must fit"),
    ],
)
def test_impossible_requests_name_the_numbers(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(cluster_of(2, 8), **flags)


def test_config_slice_checks_its_own_flags() -> None:
    with pytest.raises(ConfigError, match="--node-port-last=100"):
        ClusterConfig(node_port_first=2000, node_port_last=1500 - 1400)
    with pytest.raises(ConfigError, match="--rollout-external-engine-addrs='nohost'"):
        ClusterConfig(rollout_external_engine_addrs=["nohost"])
    with pytest.raises(ConfigError, match="--rollout-external-engine-addrs"):
        ClusterConfig(rollout_external=True)
    with pytest.raises(ConfigError, match="--colocate"):
        ClusterConfig(colocate=True, rollout_external_engine_addrs=["h:1"])
    assert ClusterConfig(offload=True).offloads_train and not ClusterConfig().offloads_rollout
    assert not ClusterConfig(colocate=True, offload_rollout=False).offloads_rollout


def test_critic_and_reference_groups() -> None:
    shared = plan(cluster_of(2, 8), critic_num_nodes=1, critic_num_gpus_per_node=4, rollout_num_gpus=8)
    critic = shared.train_group("critic")
    assert (
        critic is not None
        and critic.shares_devices_with == "actor"
        and critic.nodes[0].devices == [0, 1, 2, 3]
    )
    assert critic.rdzv_endpoint != shared.train_groups[0].rdzv_endpoint
    separate = plan(
        cluster_of(3, 8),
        critic_num_nodes=1,
        critic_separate_gpus=True,
        ref_num_nodes=1,
        ref_num_gpus_per_node=4,
    )
    assert [(g.role, g.nodes[0].node, g.nodes[0].devices) for g in separate.train_groups] == [
        ("actor", 0, list(range(8))),
        ("critic", 1, list(range(8))),
        ("reference", 2, [0, 1, 2, 3]),
    ]
    assert [e.parts[0].devices for e in separate.engines] == [[4], [5], [6], [7]]


def write_groups(tmp_path: Path, text: str) -> str:
    path = tmp_path / "groups.yaml"
    path.write_text(text)
    return str(path)


def test_server_groups_yaml_both_shapes_and_placeholders(tmp_path: Path) -> None:
    flat = write_groups(
        tmp_path,
        "server_groups:\n"
        "  - {worker_type: prefill, num_gpus: 4, num_gpus_per_engine: 2, overrides: {chunked_prefill_size: 4096}}\n"
        "  - {worker_type: placeholder, num_gpus: 2}\n"
        "  - {worker_type: decode, num_gpus: 2}\n",
    )
    p = plan(cluster_of(2, 8), sglang_config=flat, rollout_num_gpus=8)
    assert [(e.worker_type, e.tp_size, e.parts[0].devices) for e in p.engines] == [
        ("prefill", 2, [0, 1]),
        ("prefill", 2, [2, 3]),
        ("decode", 1, [6]),
        ("decode", 1, [7]),
    ]
    assert p.engines[0].overrides == {"chunked_prefill_size": 4096}
    assert [(r.group, [b.device for b in r.bundles]) for r in p.reserved] == [("default", [4, 5])]
    assert p.weight_sync is not None and [s.rank_offset for s in p.weight_sync.engines] == [1, 3, 5, 6]

    nested = write_groups(tmp_path, "sglang:\n  - name: policy\n    server_groups:\n      - {num_gpus: 4}\n")
    groups = load_server_groups(nested, default_per_engine=2)
    assert [(g.name, g.num_gpus_per_engine) for g in groups] == [("policy", 2)]
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus=6: differs from the 4 devices"):
        plan(cluster_of(2, 8), sglang_config=nested, rollout_num_gpus=6)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "server_groups:\n  - {num_gpus: 3, num_gpus_per_engine: 2}\n",
            r"server_groups\[0\].num_gpus=3: is not a multiple of the engine size 2",
        ),
        (
            "server_groups:\n  - {num_gpus: 2, worker_type: bogus}\n",
            r"invalid server groups: Invalid enum value 'bogus'",
        ),
        ("server_groups: []\n", "declares no server groups"),
        ("other: 1\n", "invalid server groups"),
        ("{}\n", "exactly one of the keys"),
        ("server_groups: [\n", "not valid YAML"),
    ],
)
def test_bad_server_group_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_server_groups(write_groups(tmp_path, text), default_per_engine=1)

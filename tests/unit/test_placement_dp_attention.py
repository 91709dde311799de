"""Engine ports under SGLang's attention data parallelism: SGLang 0.5.23 binds ports at fixed
offsets above --dist-init-addr's port (PortArgs.init_new: +1..+6; the DP controller's handshake:
+13), so the plan keeps them for the engine, and `tether plan --json` shows them. Nothing starts."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tether.commands.plan import main_argv
from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config, uses_dp_attention
from tether.run.nodes.ports import local_ports

NODE = Node(hostname="box", address="10.0.0.7", gpus=[Gpu(index=g) for g in range(8)])


def sglang_binds(dist_init_addr: str) -> set[int]:
    """What SGLang 0.5.23 binds beside an attention-DP engine's dist-init port."""
    dist = int(dist_init_addr.rpartition(":")[2])
    return {dist + k for k in range(1, 7)} | {dist + 13}


def planned_ports(plan: Plan) -> list[int]:
    """Every port the plan hands to a process of its own (not the ones kept for SGLang)."""
    ports = [int(group.rdzv_endpoint.rpartition(":")[2]) for group in plan.train_groups]
    for engine in plan.engines:
        assert engine.nccl_port is not None and engine.dist_init_addr is not None
        ports += [engine.http_port, engine.nccl_port, int(engine.dist_init_addr.rpartition(":")[2])]
    assert plan.weight_sync is not None
    return [*ports, plan.weight_sync.master_port]


@pytest.mark.parametrize(
    "sglang_args",
    [["--enable-dp-attention", "--dp-size", "2"], ["--attn-dp-size=2"], ["--attn-dp-size", "4"]],
)
def test_dp_attention_ports_are_kept_free_and_distinct_across_engines(sglang_args: list[str]) -> None:
    cluster = ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=6, rollout_num_gpus_per_engine=2)
    plan = plan_from_config(
        cluster, False, False, Inventory(nodes=[NODE]), resolve=lambda name: None, sglang_args=sglang_args
    )
    assert len(plan.engines) == 3
    own = planned_ports(plan)
    assert len(own) == len(set(own))
    seen: set[int] = set()
    for engine in plan.engines:
        assert engine.dist_init_addr is not None
        bound = sglang_binds(engine.dist_init_addr)
        assert bound <= set(engine.dp_attention_ports)
        assert not bound & set(own), (
            f"engine {engine.index}: SGLang's ports {sorted(bound & set(own))} planned"
        )
        assert not bound & seen  # no two engines' SGLang ports meet
        seen |= set(engine.dp_attention_ports)
        assert max(engine.dp_attention_ports) <= cluster.node_port_last
    # The head claims and checks them too (the plan's hosts taken as this machine's).
    local = {port for _, port in local_ports(plan, here={NODE.address})}
    assert seen <= local


def test_without_dp_attention_no_port_is_kept() -> None:
    cluster = ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    for args in ([], ["--dp-size", "2"], ["--attn-dp-size", "1"]):
        plan = plan_from_config(
            cluster, False, False, Inventory(nodes=[NODE]), resolve=lambda name: None, sglang_args=args
        )
        assert [e.dp_attention_ports for e in plan.engines] == [[], []]
        assert [e.http_port for e in plan.engines] == [20001, 20004]  # consecutive blocks of three


@pytest.mark.parametrize(
    ("args", "overrides", "expected"),
    [
        (["--enable-dp-attention"], {}, True),
        (["--enable_dp_attention", "--mem-fraction-static", "0.7"], {}, True),
        (["--attn-dp-size", "2"], {}, True),
        (["--attn-dp-size", "1"], {}, False),
        ([], {"enable_dp_attention": True}, True),
        ([], {"attn_dp_size": 8}, True),
        (["--enable-dp-attention"], {"enable_dp_attention": False}, False),  # the group's word wins
        (["--attn-dp-size", "2"], {"attn-dp-size": None}, False),
        (["--mem-fraction-static", "0.7"], {"mem_fraction_static": 0.5}, False),
    ],
)
def test_uses_dp_attention_reads_passthrough_then_group_overrides(
    args: list[str], overrides: dict[str, object], expected: bool
) -> None:
    assert uses_dp_attention(args, overrides) is expected  # type: ignore[arg-type]


def test_group_override_reserves_ports_for_its_engines_only(tmp_path: Path) -> None:
    groups = tmp_path / "groups.yaml"
    groups.write_text(
        "server_groups:\n"
        "  - {name: plain, num_gpus: 2}\n"
        "  - {name: dpa, num_gpus: 2, overrides: {enable_dp_attention: true, dp_size: 2}}\n"
    )
    cluster = ClusterConfig(
        actor_num_gpus_per_node=2, rollout_num_gpus_per_engine=2, sglang_config=str(groups)
    )
    plan = plan_from_config(cluster, False, False, Inventory(nodes=[NODE]), resolve=lambda name: None)
    plain, dpa = plan.engines
    assert plain.dp_attention_ports == []
    assert dpa.dist_init_addr is not None and sglang_binds(dpa.dist_init_addr) <= set(dpa.dp_attention_ports)
    assert plan.weight_sync is not None and plan.weight_sync.master_port > max(dpa.dp_attention_ports)


def test_tether_plan_json_shows_the_kept_ports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = tmp_path / "inventory.json"
    inventory.write_bytes(msgspec.json.encode(Inventory(nodes=[NODE])))
    flags = ["--inventory", str(inventory), "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4"]
    flags += ["--rollout-num-gpus-per-engine", "2", "--sglang-enable-dp-attention", "--sglang-dp-size", "2"]
    assert main_argv(["--json", *flags]) == 0
    plan = msgspec.json.decode(capsys.readouterr().out, type=Plan)
    for engine in plan.engines:
        assert engine.dist_init_addr is not None
        assert sglang_binds(engine.dist_init_addr) <= set(engine.dp_attention_ports)
    assert not {p for e in plan.engines for p in e.dp_attention_ports} & set(planned_ports(plan))

"""A CPU plan (--cpu-devices) on a machine with GPUs: every process it starts (each torchrun job
of the actor, critic and reference groups, and every engine of either backend) gets
CUDA_VISIBLE_DEVICES="", so torch there finds no CUDA and uses gloo. Nothing is started."""

from __future__ import annotations

from pathlib import Path

from support.plans import sglang_cfg

from tether.config import resolve
from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.records.run_dir import RunDir
from tether.rollout.engine_api.launch import build_launch
from tether.run.trainer_pool import TrainerPool
from tether.runtime.process.supervisor import LOCAL

HIDDEN = {"CUDA_VISIBLE_DEVICES": ""}


def cpu_plan_on_a_gpu_host() -> Plan:
    gpus = [Gpu(index=g, uuid=f"GPU-{g}") for g in range(8)]
    inventory = Inventory(nodes=[Node(hostname="box", address="127.0.0.1", gpus=gpus)])
    cluster = ClusterConfig(
        cpu_devices=4,
        actor_num_gpus_per_node=1,
        ref_num_nodes=1,
        ref_num_gpus_per_node=1,
        rollout_num_gpus=2,
    )
    return plan_from_config(cluster, False, False, inventory, resolve=lambda name: None, use_critic=True)


def test_cpu_plan_hides_the_hosts_gpus_from_every_bundle() -> None:
    plan = cpu_plan_on_a_gpu_host()
    assert plan.device_kind == "cpu"
    assert sorted(group.role for group in plan.train_groups) == ["actor", "critic", "reference"]
    for group in plan.train_groups:
        for node in group.nodes:
            assert node.env == HIDDEN, group.role
    assert len(plan.engines) == 2
    for engine in plan.engines:
        for part in engine.parts:
            assert part.env == HIDDEN, engine.index


def test_cpu_plan_processes_start_with_no_gpu_visible(tmp_path: Path) -> None:
    plan = cpu_plan_on_a_gpu_host()
    cfg = resolve(["--cpu-devices", "4"])
    for role in ("actor", "critic", "reference"):
        pool = TrainerPool(None, plan, cfg, RunDir(tmp_path / role), b"s" * 32, {0: LOCAL}, role=role)  # type: ignore[arg-type]
        group = plan.train_group(role)
        assert group is not None
        for node in group.nodes:
            assert pool._spec(node).env["CUDA_VISIBLE_DEVICES"] == "", role
    for backend in ("cpu", "sglang"):
        launch_cfg = sglang_cfg(device_kind="cpu", backend=backend)
        for engine in plan.engines:
            for spec in build_launch(engine, launch_cfg).specs:
                assert spec.env["CUDA_VISIBLE_DEVICES"] == "", (backend, spec.name)

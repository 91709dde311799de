"""The engine launcher: argument layering, SGLang's own parser as a contract, readiness, and
failure with the log tail, for both backends; the sglang-router command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from engine_fixtures import find_sglang_python, local_plan_engine, start_supervised

from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import EnginePart, plan_from_config
from tether.rollout.config import RolloutConfig
from tether.rollout.engine_api.launch import (
    EngineLaunchConfig,
    build_launch,
    parse_flags,
    server_argv,
    sglang_python,
    start_engine,
)
from tether.rollout.sglang_router import RouterLaunchConfig, router_argv
from tether.runtime.config import FaultToleranceConfig
from tether.runtime.errors import ActorDied, ConfigError
from tether.runtime.loop import run
from tether.runtime.secret import new_secret
from tether.runtime.supervisor import Supervisor

PY = "/opt/sglang/bin/python"


def sglang_cfg(**fields: object) -> EngineLaunchConfig:
    values: dict[str, object] = {"model_path": "/models/m", "sglang_python": PY, "device_kind": "gpu"}
    values.update(fields)
    return msgspec.convert(values, EngineLaunchConfig)


def gpu_plan(tmp_path: Path, **flags: object):  # type: ignore[no-untyped-def]
    inventory = Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(4)])
            for i in range(2)
        ]
    )
    cluster = msgspec.convert(flags, ClusterConfig)
    return plan_from_config(cluster, True, False, inventory, resolve=lambda name: None)


def test_sglang_argv_layers_plan_defaults_passthrough_and_overrides() -> None:
    engine = local_plan_engine(
        3, tp_size=2, overrides={"mem_fraction_static": 0.5, "enable_metrics": False, "cuda_graph_bs": [1, 2]}
    )
    part = engine.parts[0]
    argv = server_argv(
        engine,
        part,
        sglang_cfg(
            device_kind="cpu",
            sglang_args=["--mem-fraction-static", "0.8", "--enable-metrics", "--max-total-tokens=4096"],
        ),
    )
    assert argv[:3] == [PY, "-m", "sglang.launch_server"]
    flags = parse_flags(argv[3:], "argv")
    assert flags["model-path"] == ["/models/m"]
    assert flags["host"] == ["127.0.0.1"] and flags["port"] == [str(engine.http_port)]
    assert flags["tp-size"] == ["2"] and flags["nccl-port"] == [str(engine.nccl_port)]
    assert flags["dist-init-addr"] == [engine.dist_init_addr]
    assert "nnodes" not in flags  # one node: SGLang's default
    assert flags["device"] == ["cpu"] and flags["attention-backend"] == ["torch_native"]
    assert flags["max-total-tokens"] == ["4096"]  # pass-through beats the CPU default
    assert flags["mem-fraction-static"] == ["0.5"]  # the group override beats pass-through
    assert "enable-metrics" not in flags  # false in the group removes a pass-through switch
    assert flags["cuda-graph-bs"] == ["1", "2"]
    launch = build_launch(engine, sglang_cfg(device_kind="cpu"))
    assert launch.specs[0].env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert launch.url == f"http://127.0.0.1:{engine.http_port}" and launch.name == "engine3"


def test_plan_owned_flags_are_refused_with_the_flag_to_use() -> None:
    engine = local_plan_engine()
    with pytest.raises(ConfigError, match=r"--tp-size.*--rollout-num-gpus-per-engine"):
        server_argv(engine, engine.parts[0], sglang_cfg(sglang_args=["--tp-size", "4"]))
    with pytest.raises(ConfigError, match=r"group 'default'.overrides.*--port"):
        server_argv(local_plan_engine(overrides={"port": 1}), engine.parts[0], sglang_cfg())
    with pytest.raises(ConfigError, match=r"--sglang-\*='7'.*expected a --flag"):
        server_argv(engine, engine.parts[0], sglang_cfg(sglang_args=["7"]))


def test_engine_spanning_nodes_starts_followers_first_with_plan_devices(tmp_path: Path) -> None:
    plan = gpu_plan(
        tmp_path,
        actor_num_gpus_per_node=0,
        rollout_num_gpus_per_engine=8,
        rollout_engines_may_span_nodes=True,
    )
    (engine,) = plan.engines
    cfg = EngineLaunchConfig.from_config(
        RolloutConfig(hf_checkpoint="/models/m"),
        FaultToleranceConfig(rollout_health_check_first_wait=42.0),
        ["--router-policy", "cache_aware", "--chunked-prefill-size", "512"],
        plan,
        sglang_python=PY,
    )
    nodes = {"n0": "local", "n1": "node-b"}
    launch = build_launch(engine, cfg, node_name=lambda part: nodes[part.hostname])
    # first-wait is the start-up grace (slime's meaning); heartbeats start once the engine is ready
    assert launch.ready_timeout == 42.0
    follower, head = launch.specs
    assert (follower.name, follower.node, head.name, head.node) == (
        "engine0-node1",
        "node-b",
        "engine0-node0",
        "local",
    )
    for spec, rank in ((head, "0"), (follower, "1")):
        flags = parse_flags(spec.argv[3:], "argv")
        assert flags["nnodes"] == ["2"] and flags["node-rank"] == [rank] and flags["tp-size"] == ["8"]
        assert flags["dist-init-addr"] == [engine.dist_init_addr] and flags["chunked-prefill-size"] == ["512"]
        assert "router-policy" not in flags and "device" not in flags  # router flags go to the router
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    # Each part's agent binds its collectives to that part's node address (the engine's host
    # is the first node's; a follower's comes from the plan).
    assert (head.address, follower.address) == (engine.host, "")
    addresses = {n.index: n.address for n in plan.nodes}
    placed = build_launch(engine, cfg, node_address=lambda part: addresses[part.node])
    by_rank = {part.node_rank: addresses[part.node] for part in engine.parts}
    assert [spec.address for spec in placed.specs] == [by_rank[1], by_rank[0]]  # follower, head
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine"):
        build_launch(engine, msgspec.structs.replace(cfg, backend="cpu"))
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        EngineLaunchConfig.from_config(RolloutConfig(), FaultToleranceConfig(), [], plan)


def test_cpu_backend_argv_keeps_shared_flags_only() -> None:
    engine = local_plan_engine(overrides={"context_length": 256})
    argv = server_argv(
        engine,
        engine.parts[0],
        sglang_cfg(
            backend="cpu", sglang_args=["--max-running-requests", "8", "--mem-fraction-static", "0.5"]
        ),
    )
    assert argv[:3] == [sys.executable, "-m", "tether.rollout.cpu_engine"]
    flags = parse_flags(argv[3:], "argv")
    assert flags == {
        "model-path": ["/models/m"],
        "host": ["127.0.0.1"],
        "port": [str(engine.http_port)],
        "max-running-requests": ["8"],
        "context-length": ["256"],
    }


def test_sglang_python_resolution(tmp_path: Path) -> None:
    assert sglang_python("/x/python", {"TETHER_SGLANG_PYTHON": "/y"}) == "/x/python"
    assert sglang_python(None, {"TETHER_SGLANG_PYTHON": "/y"}) == "/y"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert sglang_python(None, {"TETHER_SGLANG_VENV": str(venv)}) == str(venv / "bin" / "python")
    assert sglang_python(None, {"TETHER_SGLANG_VENV": str(tmp_path / "none")}) == sys.executable


def test_router_argv_regular_and_prefill_decode() -> None:
    a, b = local_plan_engine(0), local_plan_engine(1)
    launches = [build_launch(e, sglang_cfg()) for e in (a, b)]
    cfg = RouterLaunchConfig(
        port=9000, policy="consistent_hash", sglang_args=["--router-max-payload-size", "9"]
    )
    argv = router_argv(launches, msgspec.structs.replace(cfg, python=PY))
    assert argv[:3] == [PY, "-m", "sglang_router.launch_router"]
    flags = parse_flags(argv[3:], "argv")
    assert flags["worker-urls"] == [launches[0].url, launches[1].url]
    assert flags["policy"] == ["manual"] and flags["max-payload-size"] == ["9"]
    assert flags["host"] == ["127.0.0.1"] and flags["port"] == ["9000"]

    prefill = build_launch(
        local_plan_engine(0, worker_type="prefill", overrides={"disaggregation_bootstrap_port": 8100}),
        sglang_cfg(),
    )
    decode = build_launch(local_plan_engine(1, worker_type="decode"), sglang_cfg())
    assert parse_flags(decode.specs[0].argv[3:], "argv")["disaggregation-mode"] == ["decode"]
    argv = router_argv([prefill, decode], RouterLaunchConfig(port=9000, python=PY))
    tail = argv[argv.index("--pd-disaggregation") :]
    assert tail[tail.index("--prefill") :] == ["--prefill", prefill.url, "8100", "--decode", decode.url]
    with pytest.raises(ConfigError, match="--sglang-router-port"):
        router_argv(launches, RouterLaunchConfig(port=1, python=PY, sglang_args=["--router-port", "2"]))
    with pytest.raises(ConfigError, match="prefill and decode engines together"):
        router_argv([prefill, launches[1]], RouterLaunchConfig(port=1, python=PY))


def test_cpu_engine_starts_through_the_launcher(tmp_path: Path) -> None:
    from tether.rollout.cpu_engine.tiny_model import TinyModelSpec, write_tiny_model

    model = str(write_tiny_model(tmp_path / "m", TinyModelSpec(seed=0)))
    engine, stop = start_supervised("cpu", model, tmp_path / "run", ready_timeout=120)
    try:
        out = engine.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert len(out["output_ids"]) == 4
        assert engine.request("/health_generate", method="GET")[0] == 200
    finally:
        stop()
    assert engine.log is not None and "tether cpu engine serving" in engine.log.read_text()


def test_dies_first_fails_at_once_with_log_tail(tmp_path: Path) -> None:
    # A python without SGLang: the process exits on import, long before the first-wait deadline.
    engine = local_plan_engine()
    launch = build_launch(engine, sglang_cfg(sglang_python=sys.executable, ready_timeout=300))

    async def main() -> float:
        async with Supervisor(tmp_path, new_secret(), grace=2.0) as sup:
            start = time.monotonic()
            with pytest.raises(ActorDied, match=r"(?s)engine0.*exited with code 1.*No module named 'sglang'"):
                await start_engine(sup, launch)
            return time.monotonic() - start

    assert run(main()) < 60


def test_not_ready_within_first_wait_is_stopped_with_log_tail(tmp_path: Path) -> None:
    engine = local_plan_engine()
    # `python -c` holding the port's place: alive, never healthy.
    launch = build_launch(engine, sglang_cfg(sglang_python=sys.executable, ready_timeout=1.0))
    spec = launch.specs[0]
    spec.argv = [sys.executable, "-c", "import time; print('still loading', flush=True); time.sleep(120)"]

    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=2.0) as sup:
            with pytest.raises(ActorDied, match=r"(?s)not ready within 1 s.*still loading"):
                await start_engine(sup, launch)
            assert not sup.process("engine0").running

    run(main())


def test_readiness_probe_waits_for_health_generate(tmp_path: Path) -> None:
    from tether.rollout.engine_api.launch import http_ready

    engine = local_plan_engine()
    probe = http_ready(f"http://127.0.0.1:{engine.http_port}")
    assert asyncio.run(probe()) is False  # nothing listens: not ready, no exception


@pytest.mark.sglang
def test_argv_parses_with_sglangs_own_server_args_and_router_args(tmp_path: Path) -> None:
    """The contract: our argv means what we think to SGLang's and sglang-router's own parsers."""
    python, missing = find_sglang_python()
    if python is None:
        pytest.skip(f"real SGLang unavailable: {missing}")
    plan = gpu_plan(
        tmp_path,
        actor_num_gpus_per_node=0,
        rollout_num_gpus_per_engine=8,
        rollout_engines_may_span_nodes=True,
    )
    (engine,) = plan.engines
    engine = msgspec.structs.replace(engine, worker_type="prefill", overrides={"mem_fraction_static": 0.6})
    cfg = EngineLaunchConfig(
        model_path=str(tmp_path / "model"),
        sglang_python=python,
        offload=True,
        sglang_args=["--chunked-prefill-size", "512", "--enable-metrics", "--router-policy", "cache_aware"],
    )
    part: EnginePart = engine.parts[1]
    argv = server_argv(engine, part, cfg)
    cpu_argv = server_argv(
        local_plan_engine(), local_plan_engine().parts[0], msgspec.structs.replace(cfg, device_kind="cpu")
    )
    router = router_argv(
        [build_launch(engine, cfg), build_launch(local_plan_engine(1, worker_type="decode"), cfg)],
        RouterLaunchConfig(port=9001, python=python, sglang_args=cfg.sglang_args),
    )
    # Parse only (no resolution: that would look for the model and devices).
    script = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang_router.launch_router import parse_router_args
out = []
for argv in json.loads(sys.argv[1])["servers"]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    ServerArgs.from_cli_args(ns)  # the record builds from what we passed
    out.append(vars(ns))
r = parse_router_args(json.loads(sys.argv[1])["router"])
print(json.dumps({"servers": out, "router": vars(r)}, default=str))
"""
    payload = json.dumps({"servers": [argv[3:], cpu_argv[3:]], "router": router[3:]})
    proc = subprocess.run(
        [python, "-c", script, payload],
        capture_output=True,
        text=True,
        timeout=300,
        env={"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    server, cpu_server = parsed["servers"]
    assert server["model_path"] == cfg.model_path and server["host"] == engine.host
    assert server["port"] == engine.http_port and server["tp_size"] == 8
    assert server["nccl_port"] == engine.nccl_port and server["dist_init_addr"] == engine.dist_init_addr
    assert server["nnodes"] == 2 and server["node_rank"] == 1
    assert server["disaggregation_mode"] == "prefill" and server["enable_memory_saver"] is True
    assert server["mem_fraction_static"] == 0.6 and server["chunked_prefill_size"] == 512
    assert server["enable_metrics"] is True
    assert cpu_server["device"] == "cpu" and cpu_server["attention_backend"] == "torch_native"
    assert cpu_server["max_total_tokens"] == 32768
    rt = parsed["router"]
    assert rt["policy"] == "cache_aware" and rt["port"] == 9001 and rt["pd_disaggregation"] is True
    assert [u for u, _ in rt["prefill_urls"]] == [f"http://{engine.address}"] and len(rt["decode_urls"]) == 1

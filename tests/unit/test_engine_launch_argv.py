"""The engine launcher without a process: argument layering (plan, defaults, passthrough,
overrides), plan-owned flags, spanning engines, the CPU backend's flags, which python runs SGLang,
the readiness probe with nothing listening, and the sglang-router command line."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest
from support.engines import local_plan_engine
from support.plans import PY, gpu_plan, sglang_cfg

from tether.rollout.config import RolloutConfig
from tether.rollout.engine_api.launch import (
    EngineLaunchConfig,
    build_launch,
    parse_flags,
    server_argv,
    sglang_python,
)
from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_argv
from tether.runtime.config import FaultToleranceConfig
from tether.runtime.errors import ConfigError


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
        "device": ["cuda"],  # a GPU plan: the embedded engine computes on the plan's GPU
        "max-running-requests": ["8"],
        "context-length": ["256"],
    }
    on_cpu = server_argv(engine, engine.parts[0], sglang_cfg(backend="cpu", device_kind="cpu"))
    assert "device" not in parse_flags(on_cpu[3:], "argv")  # the engine's own default: the CPU


def test_only_the_cpu_engine_on_a_cpu_plan_is_forked_from_the_secretless_zygote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = local_plan_engine()
    (forked,) = build_launch(engine, sglang_cfg(backend="cpu", device_kind="cpu")).specs
    assert forked.zygote and not forked.run_secret and forked.preload == ["tether.rollout.cpu_engine.preload"]
    # The zygote's environment on top of the agent's: a fork needs the same one (fork_refusal).
    assert forked.env["OPENBLAS_NUM_THREADS"] == "1"
    forked.validate()
    for cfg in (sglang_cfg(backend="cpu"), sglang_cfg(device_kind="cpu"), sglang_cfg()):
        (spawned,) = build_launch(engine, cfg).specs  # CUDA does not survive a fork; SGLang has its venv
        assert not spawned.zygote and not spawned.preload and "OPENBLAS_NUM_THREADS" not in spawned.env
    monkeypatch.setenv("TETHER_FORK_ENGINES", "0")  # the head's switch: every engine its own interpreter
    (spawned,) = build_launch(engine, sglang_cfg(backend="cpu", device_kind="cpu")).specs
    assert not spawned.zygote and not spawned.preload and "OPENBLAS_NUM_THREADS" not in spawned.env


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


def test_readiness_probe_waits_for_health_generate(tmp_path: Path) -> None:
    from tether.rollout.engine_api.launch import http_ready

    engine = local_plan_engine()
    probe = http_ready(f"http://127.0.0.1:{engine.http_port}")
    assert asyncio.run(probe()) is False  # nothing listens: not ready, no exception

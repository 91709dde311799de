"""The engine launcher with real processes: the CPU engine started through it, SGLang's own
parser as a contract, and failure with the log tail (argument layering, readiness probes and the
sglang-router command line, which start nothing, are tests/unit/test_engine_launch_argv.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from support.e2e import tether
from support.engines import ENGINE_KEY, Engine, find_sglang_python, local_plan_engine
from support.plans import gpu_plan, sglang_cfg

from tether.placement.plan import EnginePart
from tether.rollout.engine_api.launch import EngineLaunchConfig, build_launch, server_argv, start_engine
from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_argv
from tether.runtime.errors import ActorDied
from tether.runtime.loop import run
from tether.runtime.process.supervisor import Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (a fork's changes to its own do not show here)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def test_cpu_engine_starts_through_the_launcher_forked_from_the_secretless_zygote(
    tiny_model: Path, run_dir: Path
) -> None:
    cfg = EngineLaunchConfig(
        model_path=str(tiny_model), backend="cpu", device_kind="cpu", ready_timeout=120, api_key=ENGINE_KEY
    )
    launch = build_launch(local_plan_engine(), cfg)
    engine = Engine(url=launch.url, model_path=str(tiny_model))
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}

    async def main() -> tuple[float, float]:
        secret = new_secret()
        async with Supervisor(run_dir, secret, grace=10.0) as sup:
            agent = sup._local
            assert agent is not None
            took = []
            pids = []
            for _ in range(2):  # the first start, then a restart (as the engine pool restarts one)
                started = time.monotonic()
                await start_engine(sup, launch)
                took.append(time.monotonic() - started)
                pid = sup.process("engine0").pid
                out = await asyncio.to_thread(engine.post, "/generate", generate)
                assert len(out["output_ids"]) == 4
                zygote = agent.secretless_zygote
                assert zygote is not None and agent.zygote is None  # the runtime zygote never started
                # Forked (no shim, no fresh interpreter); it answered with the engine key, which
                # reached it in the start request as the rest of its environment did.
                assert _ppid(pid) == zygote.pid
                zygote_env = _environ(zygote.pid)
                assert SECRET_ENV not in zygote_env and secret_to_env(secret) not in str(zygote_env)
                assert zygote_env["OPENBLAS_NUM_THREADS"] == "1"
                pids.append(pid)
                assert (await sup.stop("engine0")).returncode == 0
            assert pids[0] != pids[1]
            return took[0], took[1]

    first, restart = run(main())
    log = run_dir / "logs" / "engine0.log"
    assert log.read_text().count("tether cpu engine serving") == 2
    # The restart skips the imports; the first start paid them in the zygote (timing only shown).
    print(f"engine start {first:.2f} s, restart {restart:.2f} s")


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


def test_bench_engine_prints_its_figures_with_the_starts() -> None:
    # The smallest run of `tether bench engine`: one level, one reload, one round of starts.
    argv = ["--json", "--levels", "2", "--new-tokens", "2", "--reloads", "1", "--starts", "1"]
    result = json.loads(tether("bench", "engine", *argv, timeout=300).stdout)
    assert [lv["concurrency"] for lv in result["levels"]] == [2] and result["levels"][0]["tokens"] == 4
    starts = result["starts"]
    assert len(starts["spawned_s"]) == len(starts["forked_s"]) == 1 and starts["first_forked_s"] > 0
    ratio = starts["spawned_s"][0] / starts["forked_s"][0]  # of the rounded figures: within rounding
    assert starts["spawned_over_forked_median"] == pytest.approx(ratio, rel=0.02)

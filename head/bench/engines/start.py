"""How long a CPU engine takes to serve once tether's launcher starts it: spawned as a fresh
interpreter, against forked from its node's secret-less zygote (the launcher's way on a CPU plan,
`tether.rollout.engine_api.launch.forked_from_zygote`). Part of `tether bench engine`.

One supervisor, one engine name, started and stopped again and again: first forked from a
zygote not yet running (the node's first engine: the zygote's imports included), then in
alternating rounds spawned (the same spec with `zygote` off) and forked again (a second engine
of the node, or a restart). Each figure is launch to `/health_generate` answering 200, as
`start_engine` waits for it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from tether.bench.engines.launch import free_port
from tether.placement.plan import Engine, EnginePart
from tether.rollout.engine_api.auth import new_engine_key
from tether.rollout.engine_api.launch import EngineLaunch, EngineLaunchConfig, build_launch, start_engine
from tether.runtime.process.supervisor import Supervisor
from tether.runtime.rpc.secret import new_secret


def _plan_engine() -> Engine:
    """One engine on 127.0.0.1, shaped as the placement plan makes it."""
    http_port = free_port()
    part = EnginePart(
        node=0, hostname="localhost", node_rank=0, devices=[0], cuda_visible_devices=None, env={}
    )
    return Engine(
        index=0,
        group="default",
        worker_type="regular",
        external=False,
        tp_size=1,
        host="127.0.0.1",
        http_port=http_port,
        address=f"127.0.0.1:{http_port}",
        nccl_port=free_port(),
        dist_init_addr=f"127.0.0.1:{free_port()}",
        nnodes=1,
        parts=[part],
        weight_sync_rank_offset=None,
    )


async def _timed_start(sup: Supervisor, launch: EngineLaunch) -> float:
    started = time.perf_counter()
    await start_engine(sup, launch)
    took = time.perf_counter() - started
    for spec in launch.specs:
        await sup.stop(spec.name)
    return took


async def engine_starts(model_path: str, rounds: int, run_dir: Path) -> dict[str, Any]:
    """The figures above, over `rounds` alternating rounds."""
    cfg = EngineLaunchConfig(
        model_path=model_path, backend="cpu", device_kind="cpu", ready_timeout=120.0, api_key=new_engine_key()
    )
    forked = build_launch(_plan_engine(), cfg)
    spawned = msgspec.structs.replace(
        forked, specs=[msgspec.structs.replace(s, zygote=False, preload=[]) for s in forked.specs]
    )
    async with Supervisor(run_dir, new_secret(), grace=10.0) as sup:
        first = await _timed_start(sup, forked)
        pairs = [(await _timed_start(sup, spawned), await _timed_start(sup, forked)) for _ in range(rounds)]
    spawned_s = [p[0] for p in pairs]
    forked_s = [p[1] for p in pairs]
    return {
        "first_forked_s": round(first, 4),
        "spawned_s": [round(s, 4) for s in spawned_s],
        "forked_s": [round(s, 4) for s in forked_s],
        "spawned_over_forked_median": round(statistics.median(a / b for a, b in pairs), 2),
    }

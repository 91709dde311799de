"""`tether bench runtime`: a real, tiny run of every figure (without Ray, which CI does not
install), with its floors measured in the same run."""

from __future__ import annotations

import json

import pytest
from support.e2e import tether

from tether.bench.runtime.bench import BATCH_SIZES, RTT_VS_RAW_PYZMQ_TARGET
from tether.bench.runtime.floors import FLOORS, LoopEchoClient


def test_bench_runtime_json_figures_and_floors() -> None:
    done = tether(
        "bench",
        "runtime",
        "--json",
        "--repeats",
        "1",
        "--skip-ray",
        "--calls",
        "100",
        "--batch-rounds",
        "2",
        timeout=300,
    )
    result = json.loads(done.stdout)
    assert result["ray"] is None and result["ray_version"] is None and result["transport"] == "auto"
    figures = result["tether"]
    keys = {"cold_start_s", "rtt_p50_s", "rtt_p99_s", "pipelined_calls_per_s"}
    for n in BATCH_SIZES:
        keys |= {f"samples_per_s_{n}", f"full_samples_per_s_{n}", f"full_samples_materialized_per_s_{n}"}
    assert set(figures) == keys
    for key, stats in figures.items():
        assert 0 < stats["min"] <= stats["median"], key
    assert figures["rtt_p50_s"]["median"] <= figures["rtt_p99_s"]["median"]
    floors = {name: result[name]["rtt_p50_s"]["median"] for name in FLOORS}
    assert set(floors) == {"raw_pyzmq", "raw_unix_socket", "raw_loop_caller_pyzmq", "raw_loop_pyzmq"}
    assert all(0 < v < 1.0 for v in floors.values()), floors
    # the ratios are the medians of this run, and the verdict follows from them
    ratios = result["ratios"]
    ratio = ratios["rtt_p50_vs_raw_pyzmq"]
    assert ratio == figures["rtt_p50_s"]["median"] / floors["raw_pyzmq"]
    assert ratios["rtt_p50_vs_raw_loop_pyzmq"] == figures["rtt_p50_s"]["median"] / floors["raw_loop_pyzmq"]
    assert ratios["raw_loop_pyzmq_vs_raw_pyzmq"] == floors["raw_loop_pyzmq"] / floors["raw_pyzmq"]
    caller = ratios["raw_loop_caller_pyzmq_vs_raw_pyzmq"]
    assert caller == floors["raw_loop_caller_pyzmq"] / floors["raw_pyzmq"]
    assert RTT_VS_RAW_PYZMQ_TARGET == 1.25  # issue #37's target
    assert result["targets_met"] == {"rtt_p50_vs_raw_pyzmq": ratio <= 1.25}


@pytest.mark.parametrize("served_by_loop", [True, False], ids=["loop-served", "blocking-rep-served"])
def test_the_event_loop_floors_echo_and_stop_their_process(served_by_loop: bool) -> None:
    # a real echo process (a ROUTER on a loop, or the blocking REP echo) and a uvloop loop on a
    # thread of its own
    floor = LoopEchoClient(served_by_loop=served_by_loop)
    try:
        times = floor.round_trips(50)
        assert len(times) == 50 and all(0 < t < 10 for t in times)
    finally:
        floor.close()
    assert floor.proc.returncode == 0  # the echo answered "stop" and exited
    assert not floor._thread.is_alive()

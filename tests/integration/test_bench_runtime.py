"""`tether bench runtime`: a real, tiny run of every figure (without Ray, which CI does not
install), with both floors measured in the same run."""

from __future__ import annotations

import json

from support.e2e import tether

from tether.bench.runtime import BATCH_SIZES


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
    assert result["ray"] is None and result["transport"] == "auto"
    figures = result["tether"]
    keys = {"cold_start_s", "rtt_p50_s", "rtt_p99_s", "pipelined_calls_per_s"}
    for n in BATCH_SIZES:
        keys |= {f"samples_per_s_{n}", f"full_samples_per_s_{n}", f"full_samples_materialized_per_s_{n}"}
    assert set(figures) == keys
    for key, stats in figures.items():
        assert 0 < stats["min"] <= stats["median"], key
    assert figures["rtt_p50_s"]["median"] <= figures["rtt_p99_s"]["median"]
    floors = {name: result[name]["rtt_p50_s"]["median"] for name in ("raw_pyzmq", "raw_unix_socket")}
    assert all(0 < v < 1.0 for v in floors.values()), floors
    # the ratio is the two medians of this run, and its verdict follows from it
    ratio = result["ratios"]["rtt_p50_vs_raw_pyzmq"]
    assert ratio == figures["rtt_p50_s"]["median"] / floors["raw_pyzmq"]
    assert result["targets_met"] == {"rtt_p50_vs_raw_pyzmq": ratio <= 1.5}

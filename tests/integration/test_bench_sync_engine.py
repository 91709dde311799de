"""`tether bench sync`'s engine figures, tiny: `--per-request-buckets` and
`--engine-allow-nonfinite-weights` reach the engine (the arithmetic of the figures:
tests/unit/test_bench_sync_figures.py)."""

from __future__ import annotations

import json

from support.e2e import tether

TINY = ["--skip-delta", "--engine-hidden", "64", "--engine-layers", "1", "--bucket-mib", "1", "--syncs", "1"]


def _engine(*flags: str) -> dict[str, object]:
    done = tether("bench", "sync", "--json", *TINY, *flags, timeout=300)
    engine: dict[str, object] = json.loads(done.stdout)["engine"]
    return engine


def test_bench_sync_flags_reach_the_engine() -> None:
    default = _engine()
    # The CPU engine offers the streamed update and checks values unless told otherwise.
    assert default["engine_checks_values"] is True
    check = default["value_check_gb_s"]  # the check alone, beside the sync it costs
    assert isinstance(check, float) and check > 0
    rows = default["distributed_by_bucket"]
    assert isinstance(rows, list) and [(r["flattened_bucket"], r["streamed"]) for r in rows] == [
        (False, True),
        (True, True),
    ]
    asked = _engine("--per-request-buckets", "--engine-allow-nonfinite-weights")
    assert asked["engine_checks_values"] is False  # as the engine reports it
    rows = asked["distributed_by_bucket"]
    assert isinstance(rows, list) and all(r["streamed"] is False for r in rows)
    for row in rows:
        assert row["best_gb_s"] > 0 and row["over_raw"] > 0

"""`tether bench sync`'s own logic, without running it: the raw-write baseline, the targets per
row and overall, and --compare on its results."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tether.bench.compare import compare
from tether.bench.sync.bench import add_arguments, main, raw_write_gb_s, sync_targets, value_check_gb_s
from tether.runtime.errors import ConfigError


def _result(over_raw: list[float], first_gb_s: float, raw_write_gb_s: float = 2.0) -> dict[str, Any]:
    rows = [
        {"bucket_mib": 64, "flattened_bucket": i % 2 == 1, "over_raw": r,
         "targets_met": {"at_least_0_85_of_raw": r >= 0.85}}
        for i, r in enumerate(over_raw)
    ]  # fmt: skip
    delta = {
        "changed_fraction": 0.01, "delta_over_full": 0.012, "encode_gb_s": 1.2,
        "apply_verify_first_gb_s": first_gb_s, "raw_write_gb_s": raw_write_gb_s,
        "targets_met": {"apply_verify_at_least_1_5_gb_s": True,
                        "apply_verify_first_at_least_1_5_gb_s": first_gb_s >= 1.5,
                        "apply_verify_first_at_least_0_9_of_raw_write": first_gb_s / raw_write_gb_s >= 0.9},
    }  # fmt: skip
    return {"delta": [delta], "engine": {"distributed_by_bucket": rows}}


def test_every_row_must_reach_0_85_of_raw_not_only_the_best() -> None:
    assert sync_targets(_result([0.95, 0.91], 1.6)) == {
        "delta_1pct_at_most_5pct": True,
        "encode_at_least_1_gb_s": True,
        "apply_verify_at_least_1_5_gb_s": True,
        "apply_verify_first_at_least_1_5_gb_s": True,
        "apply_verify_first_at_least_0_9_of_raw_write": False,  # 1.6 of a 2.0 GB/s disk
        "distributed_every_row_at_least_0_85_of_raw": True,
    }
    # A disk slower than the absolute target: the first apply is held to what it allows too.
    slow_disk = sync_targets(_result([0.95], 0.4, raw_write_gb_s=0.37))
    assert slow_disk["apply_verify_first_at_least_1_5_gb_s"] is False
    assert slow_disk["apply_verify_first_at_least_0_9_of_raw_write"] is True
    worse = sync_targets(_result([0.99, 0.84], 1.4))
    assert worse["distributed_every_row_at_least_0_85_of_raw"] is False
    assert worse["apply_verify_first_at_least_1_5_gb_s"] is False
    # A part not measured has no target rather than a failed one.
    assert sync_targets({"engine": _result([0.95], 1.6)["engine"]}) == {
        "distributed_every_row_at_least_0_85_of_raw": True
    }


def test_compare_lists_each_rows_figures_and_flipped_targets() -> None:
    before, after = _result([0.5, 0.4], 0.5), _result([0.95, 0.4], 0.6)
    for r in (before, after):
        r["targets"] = sync_targets(r)
    got = compare(before, after)
    assert got["figures"]["engine.distributed_by_bucket[0].over_raw"]["ratio"] == pytest.approx(1.9)
    assert got["flipped"] == {
        "engine.distributed_by_bucket[0].targets_met.at_least_0_85_of_raw": {"before": False, "after": True}
    }


def test_raw_write_baseline_leaves_nothing_behind(tmp_path: Path) -> None:
    assert raw_write_gb_s(tmp_path, 5 * 1024**2 + 3) > 0
    assert list(tmp_path.iterdir()) == []


def test_skipping_both_parts_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--skip-delta", "--skip-engine"])
    with pytest.raises(ConfigError, match="--skip-engine=True: with --skip-delta leaves nothing to measure"):
        main(args)


def test_the_value_check_figure_refuses_weights_it_would_refuse() -> None:
    import torch

    fine = {"w": torch.ones(1024), "b": torch.zeros(16, dtype=torch.bfloat16)}
    assert value_check_gb_s(fine, repeats=1) > 0
    with pytest.raises(RuntimeError, match="NaN or inf"):
        value_check_gb_s({"w": torch.tensor([1.0, float("nan")])}, repeats=1)

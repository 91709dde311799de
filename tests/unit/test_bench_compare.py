"""`tether bench NAME --compare FILE`: figures matched by path, ratios, flipped targets, bad files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tether.bench import compare
from tether.runtime.errors import ConfigError


def test_figures_are_matched_by_path_with_their_ratio() -> None:
    before = {
        "rtt": {"p50_us": 100.0, "p99_us": 0},
        "modes": {"sync": {"steps": [1, 2]}},
        "targets_met": {"a": False},
    }
    after = {
        "rtt": {"p50_us": 50.0, "p99_us": 3},
        "modes": {"sync": {"steps": [1, 4]}},
        "targets_met": {"a": True},
        "new": 1,
    }
    got = compare.compare(before, after)
    assert got["figures"]["rtt.p50_us"] == {"before": 100.0, "after": 50.0, "ratio": 0.5}
    assert got["figures"]["rtt.p99_us"]["ratio"] is None  # nothing to divide by
    assert got["figures"]["modes.sync.steps[1]"]["ratio"] == 2.0
    assert "targets_met.a" not in got["figures"]  # booleans are not figures
    assert got["flipped"] == {"targets_met.a": {"before": False, "after": True}}
    assert got["only_after"] == ["new"] and got["only_before"] == []
    assert "rtt.p50_us" in compare.compare_table(got)


def test_with_comparison_reads_the_earlier_result(tmp_path: Path) -> None:
    earlier = tmp_path / "old.json"
    earlier.write_text(json.dumps({"x": 2.0, "compare": {"stale": True}}))
    shown = compare.with_comparison({"x": 3.0}, argparse.Namespace(compare=earlier))
    assert shown["compare"]["figures"] == {"x": {"before": 2.0, "after": 3.0, "ratio": 1.5}}
    assert compare.with_comparison({"x": 3.0}, argparse.Namespace(compare=None)) == {"x": 3.0}


@pytest.mark.parametrize(("content", "why"), [("{not json", "cannot read"), ("[1, 2]", "not a JSON object")])
def test_a_bad_earlier_file_is_refused_naming_it(tmp_path: Path, content: str, why: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ConfigError, match=rf"--compare='{bad}'.*{why}"):
        compare.load_result(bad)


def test_every_bench_takes_compare(tmp_path: Path) -> None:
    from tether import bench

    with pytest.raises(ConfigError, match=r"--compare=.*cannot read"):
        bench.main_argv(["runtime", "--compare", str(tmp_path / "missing.json")])

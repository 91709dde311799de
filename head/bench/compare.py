"""`tether bench NAME --compare FILE`: each figure of this run beside the same figure of an
earlier JSON result, with the ratio, so a change shows without reading two JSON files.

Figures are matched by their path in the JSON (`rtt.p50_us`, `modes.sync.step_median_s`, ...);
only numbers present in both results are compared, and targets that flipped are listed.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError


def add_compare_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="FILE",
        help="An earlier JSON result of this benchmark: print each figure's change against it.",
    )


def load_result(path: Path) -> dict[str, Any]:
    """An earlier result; a file that is not a JSON object is refused naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError("--compare", str(path), f"cannot read an earlier JSON result: {why}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            "--compare", str(path), f"holds {type(data).__name__}, not a JSON object of figures"
        )
    data.pop("compare", None)  # an earlier result printed with --compare carries its own
    return data


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _leaves(sub, f"{path}[{i}]")
    else:
        yield path, value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Figures in both results: {path: {before, after, ratio}} (ratio after/before, None when
    before is 0); booleans that changed (targets met or missed) under `flipped`; paths only in
    one result under `only_before` / `only_after`."""
    old = dict(_leaves(before))
    new = dict(_leaves(after))
    figures: dict[str, dict[str, float | None]] = {}
    flipped: dict[str, dict[str, bool]] = {}
    for path in sorted(old.keys() & new.keys()):
        a, b = old[path], new[path]
        if isinstance(a, bool) and isinstance(b, bool):
            if a != b:
                flipped[path] = {"before": a, "after": b}
            continue
        x, y = _number(a), _number(b)
        if x is None or y is None:
            continue
        figures[path] = {"before": x, "after": y, "ratio": None if x == 0 else y / x}
    return {
        "figures": figures,
        "flipped": flipped,
        "only_before": sorted(old.keys() - new.keys()),
        "only_after": sorted(new.keys() - old.keys()),
    }


def with_comparison(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The result, with a `compare` section when --compare named an earlier one."""
    path = getattr(args, "compare", None)
    if path is None:
        return result
    return {**result, "compare": compare(load_result(path), result)}


def compare_table(comparison: dict[str, Any]) -> str:
    """The comparison as aligned text lines, for benchmarks that print a table."""
    lines = [f"{'figure':<48} {'before':>12} {'after':>12} {'ratio':>8}"]
    for path, f in comparison["figures"].items():
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
        lines.append(f"{path:<48} {f['before']:>12.6g} {f['after']:>12.6g} {ratio:>8}")
    for path, f in comparison["flipped"].items():
        lines.append(f"{path:<48} {f['before']!s:>12} {f['after']!s:>12} {'flipped':>8}")
    return "\n".join(lines)

"""`tether bench NAME [--json] ...`: the benchmarks, each measuring its figures against a baseline
taken in the same run, and printing JSON."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType

from tether.bench.compare import add_compare_argument, load_result

BENCHES = {
    "runtime": (
        "tether.bench.runtime.bench",
        "RPC and process start-up against raw pyzmq (and Ray when installed).",
    ),
    "engine": (
        "tether.bench.engines.throughput",
        "CPU engine tokens/s at 1, 8 and 64 concurrent requests; reload time.",
    ),
    "rollout": (
        "tether.bench.engines.rollout",
        "Synchronous rollout against the fully-async worker on long-tail engines.",
    ),
    "sync": (
        "tether.bench.sync.bench",
        "Delta sizes and speeds, disk and delta sync, bucketed against raw broadcast.",
    ),
    "e2e": ("tether.bench.e2e.bench", "A short demo-sized run in each loop mode, side by side."),
}


def parse_bench_args(argv: Sequence[str]) -> tuple[ModuleType, argparse.Namespace] | None:
    """The benchmark module and its parsed arguments; None when argv names no benchmark (after
    printing the usage). bin/device-check parses its bench command with this, without running it."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        parser = argparse.ArgumentParser(prog="tether bench", description=__doc__)
        parser.add_argument(
            "name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items())
        )
        parser.parse_args(list(argv[:1]))
        return None
    module_name, description = BENCHES[argv[0]]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"tether bench {argv[0]}", description=description)
    module.add_arguments(parser)
    add_compare_argument(parser)
    args = parser.parse_args(list(argv[1:]))
    if args.compare is not None:
        load_result(args.compare)  # a bad file fails now, not after the benchmark has run
    return module, args


def main_argv(argv: Sequence[str]) -> int:
    parsed = parse_bench_args(argv)
    if parsed is None:
        return 2
    module, args = parsed
    return int(module.main(args) or 0)

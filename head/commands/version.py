"""`tether version`: the versions of tether and of what it drives, for bug reports and receipts."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform

PACKAGES = (
    "tether",
    "torch",
    "megatron-core",
    "transformers",
    "sglang",
    "pyzmq",
    "msgspec",
    "aiohttp",
    "uvloop",
)


def versions() -> dict[str, str | None]:
    """Installed versions by distribution name; None for what is not installed."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def main(args: argparse.Namespace) -> int:
    found = versions()
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        width = max(map(len, found))
        for name, version in found.items():
            print(f"{name:<{width}}  {version or 'not installed'}")
    return 0

"""`tether drain RUN_DIR NODE`: take a node's engines out of a running run and let the node go.

Asks the live head (its control socket, at the address in RUN_DIR/head_address, with the run's
secret from TETHER_SECRET, as `tether status` does) to drain NODE: the node's engines get their
requests in flight finished (or handed back and requeued), leave the rollout and the weight
syncs, and stop; the node's agent then exits 0. Returns once that is done. SIGUSR2 to the
node's agent does the same from the node itself. A node running trainer ranks is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError, RemoteError, UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory (--run-dir of `tether run`).")
    parser.add_argument("node", help="The node to drain: its agent's --node-name.")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for the drain (its engines' requests in flight end first).",
    )


def main(args: argparse.Namespace) -> int:
    from tether.runtime.loop import run
    from tether.runtime.rpc.secret import SECRET_ENV

    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "must be a positive number of seconds")
    address_file = args.run_dir / "head_address"
    if not address_file.exists():
        raise UserError(
            f"{address_file}: no such file; is a `tether run` with --run-dir {args.run_dir} running?"
        )
    if SECRET_ENV not in os.environ:
        raise UserError(f"set {SECRET_ENV} to the run's secret: the head's control socket requires it")
    address = address_file.read_text().strip()
    try:
        record = run(drain(address, args.node, args.timeout))
    except RemoteError as exc:  # refused: the head's reason names the node and why
        raise UserError(exc.message) from None
    print(json.dumps(record))
    return 0


async def drain(address: str, node: str, timeout: float, secret: bytes | None = None) -> dict[str, Any]:  # noqa: ASYNC109
    """The head's `drain_node` call; returns its `node_drained` record. `secret`: the run's
    (default: from TETHER_SECRET)."""
    from tether.runtime.rpc.actors import connect
    from tether.runtime.rpc.secret import secret_from_env

    async with asyncio.timeout(timeout + 30.0):
        handle = await connect(address, secret or secret_from_env(), name="head", timeout=30.0)
        async with handle:
            record: dict[str, Any] = await handle.call("drain_node", node, timeout=timeout)
            return record

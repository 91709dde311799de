"""`tether status RUN_DIR`: the nodes, engines, trainer ranks and step of a run.

Read from the run's records; while the run is live (its head wrote `head_address` and the
records show no end), the head's control socket is asked too, with the run's secret from
TETHER_SECRET, and its fresher answer is printed instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import msgspec

from tether.records.run_status import COLUMNS, RunStatus, from_records

ENDED = ("finished", "failed", "stopped")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="The run directory (--run-dir of `tether run`).")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of tables.")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="Seconds to wait for a live head's answer before printing the records alone.",
    )


def main(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        from tether.runtime.errors import ConfigError

        raise ConfigError("--timeout", args.timeout, "must be a positive number of seconds")
    status = from_records(args.run_dir)
    if status.state not in ENDED:
        status = ask_head(args.run_dir, status, args.timeout)
    if args.json:
        print(json.dumps(msgspec.to_builtins(status), indent=2))
    else:
        print(render(status))
    return 0


def ask_head(run_dir: Path, records: RunStatus, timeout: float) -> RunStatus:
    """The live head's answer, or `records` with a note saying why there is none."""
    from tether.runtime.rpc.secret import SECRET_ENV

    address_file = run_dir / "head_address"
    if not address_file.exists():
        records.note = "no head_address: the head has not started its control socket"
        return records
    if SECRET_ENV not in os.environ:
        records.note = f"from the records only: set {SECRET_ENV} to the run's secret for the live view"
        return records
    from tether.runtime.loop import run

    address = address_file.read_text().strip()
    try:
        answer = run(_call_status(address, timeout))
    except Exception as exc:  # a head that has gone is the common case, not an error
        records.note = (
            f"from the records only: the head at {address} did not answer ({type(exc).__name__}: {exc})"
        )
        return records
    return msgspec.convert(answer, RunStatus)


async def _call_status(address: str, timeout: float) -> object:  # noqa: ASYNC109
    import asyncio

    from tether.runtime.rpc.actors import connect
    from tether.runtime.rpc.secret import secret_from_env

    async with asyncio.timeout(timeout):
        handle = await connect(address, secret_from_env(), name="head", timeout=timeout)
        async with handle:
            return await handle.call("status", timeout=timeout)


def render(status: RunStatus) -> str:
    """Plain-text tables, one per part of the run, with the columns of COLUMNS."""
    trained = 0 if status.step is None else status.step + 1
    of = "" if status.total is None else f" of {status.total}"
    lines = [
        f"run {status.run_dir}: {status.state} (from the {status.source} view), "
        f"{trained}{of} steps trained, weights v{status.version}",
    ]
    if status.note:
        lines.append(f"note: {status.note}")
    tables = {
        "nodes": [
            [
                r.node,
                r.address,
                r.state + (f" ({r.reason})" if r.reason else "") + (" (joined)" if r.joined else ""),
            ]
            for r in status.nodes
        ],
        "engines": [
            [r.engine, r.node, r.state, _opt(r.version), _opt(r.load), str(r.restarts)]
            for r in status.engines
        ],
        "trainer": [[r.group, r.node, r.ranks, r.state] for r in status.trainer],
    }
    for title, rows in tables.items():
        lines += ["", title, *_table(list(COLUMNS[title]), rows)]
    return "\n".join(lines)


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    return [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]

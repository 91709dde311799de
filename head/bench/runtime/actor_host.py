"""`python -m tether.bench.runtime.actor_host`: the process behind `tether.bench.runtime.actors.start_actor`.

It fetches its constructor arguments from the head (`process_setup`, so they never sit on a
command line), builds the target object, serves it with `RpcServer`, tells the head its address
(`process_ready`), and runs until SIGTERM/SIGINT or until the head stops answering heartbeats
(exit code 3).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys

from tether.runtime.errors import HeartbeatLost
from tether.runtime.process.malloc_tuning import tune_malloc
from tether.runtime.process.signals import StopRequested, handle_signals
from tether.runtime.rpc.actors import RpcServer, connect
from tether.runtime.rpc.liveness import LivenessMonitor
from tether.runtime.rpc.secret import secret_from_env

log = logging.getLogger(__name__)
EXIT_HEAD_LOST = 3


def import_target(target: str) -> type:
    """`module.path:ClassName` → the class."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"actor target {target!r}: expected 'module.path:ClassName'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"actor target {target!r} is not a class")
    return obj


async def serve(args: argparse.Namespace) -> int:
    secret = secret_from_env()
    bind = args.bind or f"tcp://{os.environ.get('TETHER_BIND_HOST', '127.0.0.1')}:0"
    head = await connect(args.head, secret, name="head", timeout=30.0)
    async with head:
        setup = await head.call("process_setup", args.name, timeout=30.0)
        target = import_target(args.target)(**setup["data"])
        async with RpcServer(target, bind, secret, name=args.name) as server:
            await head.call("process_ready", args.name, server.address, timeout=30.0)
            monitor = LivenessMonitor(
                head.ping,
                interval=setup["interval"],
                timeout=setup["timeout"],
                first_wait=setup["interval"],
                misses=int(setup.get("misses", 3)),
                name="head",
            )

            async def no_checkpoint() -> None:
                return None

            rc = 0
            try:
                async with handle_signals(no_checkpoint) as stop, asyncio.TaskGroup() as tg:
                    tg.create_task(stop.raise_when_requested())
                    tg.create_task(monitor.run())
            except* StopRequested:
                rc = 0
            except* HeartbeatLost as group:
                print(f"actor {args.name!r}: {group.exceptions[0]}; exiting", file=sys.stderr, flush=True)
                rc = EXIT_HEAD_LOST
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.bench.runtime.actor_host")
    parser.add_argument("--name", required=True)
    parser.add_argument("--target", required=True, help="module.path:ClassName")
    parser.add_argument("--head", required=True, help="The head's control address.")
    parser.add_argument(
        "--bind", default=None, help="Endpoint to serve on (default tcp://$TETHER_BIND_HOST:0)."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()  # before ZeroMQ's I/O thread allocates anything
    from tether.runtime.loop import run

    return run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())

"""Actor classes and a head program used by the runtime tests (no tests in this module).

Actor processes import this module by name (`support.runtime_actors:Echo`, with tests/ on
PYTHONPATH), so it stays light. `python tests/support/runtime_actors.py head RUN_DIR` runs a small
head used by the tests that kill or signal a real head process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds the `support` package


class Echo:
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    async def echo(self, value: Any) -> Any:
        return value

    async def whoami(self) -> dict[str, Any]:
        return {"tag": self.tag, "pid": os.getpid(), "node": os.environ.get("TETHER_NODE", "")}

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def crash(self, code: int) -> None:
        print(f"crashing on purpose with code {code}", flush=True)
        os._exit(code)


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("this actor cannot be built")


class Polite:
    """An actor that exits 0 by itself when asked, as trainer ranks do."""

    async def exit(self) -> None:
        # After this call's reply is on its way; the caller may also see the connection drop.
        asyncio.get_running_loop().call_soon(os._exit, 0)


class Stubborn:
    """An actor that answers the request to exit but does not exit (a rank stuck in a step)."""

    async def exit(self) -> None:
        return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def _head(run_dir: Path) -> int:
    from tether.bench.runtime.actors import start_actor
    from tether.runtime.process.sdnotify import Notifier
    from tether.runtime.process.signals import StopRequested, handle_signals
    from tether.runtime.process.supervisor import Heartbeat, ProcessSpec, Supervisor
    from tether.runtime.rpc.secret import new_secret

    notifier = Notifier.from_env()
    checkpoints = run_dir / "checkpoints.txt"

    async def checkpoint() -> None:
        with open(checkpoints, "a") as f:  # noqa: ASYNC230  # a tiny local write
            f.write("checkpoint\n")

    hb = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3)
    async with (
        handle_signals(checkpoint) as stop,
        Supervisor(run_dir, new_secret(), grace=2.0, heartbeat=hb) as sup,
    ):
        env = {"PYTHONPATH": TESTS}
        actor = await start_actor(sup, "echo", "support.runtime_actors:Echo", {"tag": "x"}, env=env)
        sleeper = await sup.start(ProcessSpec(name="sleeper", argv=["sleep", "300"]))
        who = await actor.whoami()
        async with asyncio.timeout(10):
            while not _children(sleeper.pid):  # noqa: ASYNC110  # polling /proc until the shim forked `sleep`
                await asyncio.sleep(0.01)
        pids = {
            "head": os.getpid(),
            "actor_shim": sup.process("echo").pid,
            "actor": who["pid"],
            "sleeper_shim": sleeper.pid,
            "sleeper": _children(sleeper.pid),
        }
        print(json.dumps(pids), flush=True)
        notifier.ready()
        notifier.status("running")
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(stop.raise_when_requested())
                tg.create_task(sup.watch())
        except* StopRequested:
            notifier.stopping()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["head"]:
        from tether.runtime.loop import run

        raise SystemExit(run(_head(Path(sys.argv[2]))))
    raise SystemExit(f"usage: {sys.argv[0]} head RUN_DIR")

"""The node agent binds each process it starts to its planned address: the child's environment
names the interface holding it (GLOO/NCCL_SOCKET_IFNAME), and the user's own setting wins."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tether.runtime.loop import run
from tether.runtime.netif import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV, interface_holding
from tether.runtime.process.agent import NodeAgent
from tether.runtime.process.spec import ExitInfo, ProcessSpec
from tether.runtime.rpc.secret import new_secret


def test_agent_binds_each_process_to_its_planned_address(tmp_path: Path) -> None:
    """A child of the agent sees the interface holding its spec's address; the user's own
    GLOO_SOCKET_IFNAME (in the spec's or the agent's environment) wins."""
    exits: list[ExitInfo] = []
    show = "import os; print(os.environ.get('GLOO_SOCKET_IFNAME'), os.environ.get('NCCL_SOCKET_IFNAME'))"

    async def main() -> None:
        all_exited = asyncio.Event()

        async def on_exit(info: ExitInfo) -> None:
            exits.append(info)
            if len(exits) == len(specs):
                all_exited.set()

        async with NodeAgent("n", tmp_path, new_secret(), on_exit=on_exit, grace=1.0) as agent:
            specs = [
                ProcessSpec(name="bound", argv=[sys.executable, "-c", show], address="127.0.0.1"),
                ProcessSpec(
                    name="user",
                    argv=[sys.executable, "-c", show],
                    address="127.0.0.1",
                    env={GLOO_IFNAME_ENV: "mine"},
                ),
                ProcessSpec(name="unplanned", argv=[sys.executable, "-c", show]),
            ]
            for spec in specs:
                await agent.start_process(spec)
            async with asyncio.timeout(60):
                await all_exited.wait()

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(GLOO_IFNAME_ENV, raising=False)
        mp.delenv(NCCL_IFNAME_ENV, raising=False)
        run(main())
    lo = interface_holding("127.0.0.1")
    assert lo is not None
    tails = {info.name: info.log_tail for info in exits}
    assert tails == {"bound": f"{lo} ={lo}", "user": f"mine ={lo}", "unplanned": "None None"}

"""Nodes joining and drained through the supervisor, with real agents on 127.0.0.1 and a
stand-in for the run's capacity (the run's own is tested in test_e2e_two_nodes_netns.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tether.commands import drain as drain_command
from tether.runtime.errors import RemoteError
from tether.runtime.loop import run
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import Heartbeat, Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env

FAST = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3)


class FakeCapacity:
    """Records what the supervisor asks; refuses nodes named `refused-*`."""

    def __init__(self) -> None:
        self.joined: list[tuple[str, dict[str, Any]]] = []
        self.drained: list[str] = []
        self.join_done = asyncio.Event()

    def check_join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        if node.startswith("refused"):
            raise ValueError(f"node {node!r} cannot join this run: a test says so")

    async def join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        self.joined.append((node, inventory))
        self.join_done.set()

    async def drain(self, node: str) -> dict[str, Any]:
        self.drained.append(node)
        return {"engines": [f"engine-on-{node}"]}


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def agent(head: str, node: str, secret: bytes, *flags: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tether.runtime.process.agent", "--head", head, "--node-name", node, *flags]
    env = {**os.environ, SECRET_ENV: secret_to_env(secret)}
    return subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_node_joins_is_refused_and_is_drained(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    secret = new_secret()

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=FAST) as sup:
            # Without capacity (the run has not started its engines): a join is refused.
            early = agent(sup.address, "early", secret, "--join")
            started.append(early)
            assert await asyncio.to_thread(early.wait, 30) == 2
            assert early.stderr is not None
            assert "adds no capacity while it runs" in early.stderr.read().decode()
            capacity = FakeCapacity()
            sup.capacity = capacity
            refused = agent(sup.address, "refused-1", secret, "--join")
            started.append(refused)
            assert await asyncio.to_thread(refused.wait, 30) == 2
            assert refused.stderr is not None
            assert "the head refused node 'refused-1'" in refused.stderr.read().decode()
            # A join: registered, recorded, handed to the capacity with the devices it offers.
            joining = agent(sup.address, "c", secret, "--join", "--devices", "0,2")
            started.append(joining)
            async with asyncio.timeout(30):
                await capacity.join_done.wait()
            ((node, inventory),) = capacity.joined
            assert (node, inventory["join_devices"], inventory["address"]) == ("c", [0, 2], "127.0.0.1")
            assert sup.node_states()["c"] == {"state": "up", "reason": "", "joined": True}
            # Not drainable: the head's own node, a node unknown, a node running what the run needs.
            for name, why in (("local", "no node 'local' to drain"), ("x", "no node 'x' to drain")):
                with pytest.raises(ValueError, match=why):
                    await sup.drain(name)
            plain = agent(sup.address, "b", secret)
            started.append(plain)
            await sup.wait_for_node("b")
            await sup.start(ProcessSpec(name="needed", argv=["sleep", "600"], node="b"))
            with pytest.raises(ValueError, match=r"node 'b' runs \['needed'\]"):
                await sup.drain("b")
            await sup.stop("needed")
            # `tether drain`'s call, through the control socket: the agent exits 0, the node is drained.
            record = await drain_command.drain(sup.address, "c", timeout=30.0, secret=secret)
            assert record == {"event": "node_drained", "node": "c", "engines": ["engine-on-c"]}
            assert await asyncio.to_thread(joining.wait, 30) == 0
            assert capacity.drained == ["c"]
            assert sup.node_states()["c"] == {"state": "drained", "reason": ""}
            with pytest.raises(RemoteError, match="no node 'c' to drain"):
                await drain_command.drain(sup.address, "c", timeout=30.0, secret=secret)
            # SIGUSR2 to a joined node's agent drains it from the node itself.
            capacity.join_done.clear()
            again = agent(sup.address, "d", secret, "--join")
            started.append(again)
            async with asyncio.timeout(30):
                await capacity.join_done.wait()
            again.send_signal(signal.SIGUSR2)
            assert await asyncio.to_thread(again.wait, 30) == 0
            assert capacity.drained == ["c", "d"]
        kinds = [(e["event"], e["node"]) for e in events(tmp_path) if e["event"].startswith("node_")]
        assert kinds == [
            ("node_joined", "c"),
            ("node_drained", "c"),
            ("node_joined", "d"),
            ("node_drained", "d"),
        ], kinds
        assert not any(e["event"] == "node_lost" for e in events(tmp_path))

    run(main())

"""The RPC layer's bounded queues against a server in a process of its own that stops reading
(SIGSTOP): sends wait in the handle, in order, and all complete once it runs again."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from support.wait import until

from tether.runtime.loop import run
from tether.runtime.rpc.actors import connect
from tether.runtime.rpc.secret import new_secret

# -- bounded queues --------------------------------------------------------------------------

_STOPPABLE_SERVER = """
import asyncio, sys
from tether.runtime.loop import run
from tether.runtime.rpc.actors import RpcServer

class Echo:
    def __init__(self) -> None:
        self.arrived = 0

    async def echo(self, i: int, pad: bytes) -> list[int]:
        self.arrived += 1
        return [i, self.arrived - 1]  # the call's number and its place in arrival order

async def main() -> None:
    async with RpcServer(Echo(), "tcp://127.0.0.1:0", bytes.fromhex(sys.argv[1]), name="svc") as server:
        print(server.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes

run(main())
"""


def test_sends_to_a_server_that_stops_reading_wait_in_order() -> None:
    """A server frozen (SIGSTOP) while 4000 calls of 16 KiB go to it: ZeroMQ's bounded queues
    fill and the rest wait in the handle, in order; all complete once it runs again."""

    async def main() -> None:
        secret = new_secret()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STOPPABLE_SERVER,
            secret.hex(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            async with asyncio.timeout(30):
                address = (await proc.stdout.readline()).decode().strip()
            async with await connect(address, secret, name="svc", timeout=10.0) as h:
                pad = bytes(16 << 10)
                os.kill(proc.pid, signal.SIGSTOP)
                async with asyncio.TaskGroup() as tg:
                    calls = [tg.create_task(h.echo(i, pad, timeout=60.0)) for i in range(4000)]
                    try:
                        await until(lambda: h.queued_sends > 0, 30, "sends held back in the handle")
                    finally:
                        os.kill(proc.pid, signal.SIGCONT)
                assert [c.result() for c in calls] == [[i, i] for i in range(4000)]
                assert h.queued_sends == 0
        finally:
            proc.stdin.close()
            async with asyncio.timeout(30):
                assert await proc.wait() == 0

    run(main())

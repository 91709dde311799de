"""An engine that refuses a bucket over NCCL (two GPUs; skipped with fewer): the sender, on the
last GPU while the test's thread has GPU 0 current, is inside a broadcast the engine never
joins. The sync must raise SyncFailed naming the engine at once, leave the sender's GPU free
(its streams no longer wait on that broadcast), and the next sync must build a new group and
carry every bucket byte for byte.

The engine is this test's own: a receiving process on GPU 0 driven line by line (join a
group, receive a bucket of n bytes, drop the group), answering SGLang's calls in process.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)"
    ),
]

RECEIVER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch
    from tether.runtime.weight_group import broadcast, destroy_weight_group, init_weight_group
    gpu = torch.device("cuda", 0)
    group = None
    for line in sys.stdin:
        ask = json.loads(line)
        if "join" in ask:
            group = init_weight_group(ask["join"], 1, 2, ask["name"], "nccl", timedelta(seconds=120), device=gpu)
            answer = {"ok": True}
        elif "recv" in ask:
            buf = torch.empty(ask["recv"], dtype=torch.uint8, device=gpu)
            broadcast(buf, 0, group)
            answer = {"sum": int(buf.to(torch.int64).sum().item())}
        else:
            destroy_weight_group(group)
            answer = {"ok": True}
        print(json.dumps(answer), flush=True)
    """
)


class Engine:
    """SGLang's weight-sync calls, answered here; the bytes go to the receiving process, one
    ask at a time. Refuses its `refuse`-th bucket request (0-based) and every later one without
    receiving them (a sender running ahead has queued their broadcasts behind the first)."""

    name = "g0"
    url = "receiver"

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.refuse: int | None = 1
        self.buckets = 0
        self.version = "0"
        self.calls: list[tuple[str, Any]] = []
        self.received: list[tuple[list[str], int]] = []
        self._one_ask = threading.Lock()

    def _ask_now(self, ask: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._one_ask:
            self.proc.stdin.write(json.dumps(ask) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        assert line, "the receiving process ended"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def _ask(self, ask: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._ask_now, ask)

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        self.calls.append((path, body))
        if path == "/init_weights_update_group":
            method_url = f"tcp://{body['master_address']}:{body['master_port']}"
            await self._ask({"join": method_url, "name": body["group_name"]})
        elif path == "/destroy_weights_update_group":
            await self._ask({"drop": body["group_name"]})
        elif path == "/get_model_info":
            return {"weight_version": self.version}
        elif path == "/update_weights_from_distributed":
            k, self.buckets = self.buckets, self.buckets + 1
            if self.refuse is not None and k >= self.refuse:
                return {"success": False, "message": "dtype int32 is not supported"}
            assert set(body["dtypes"]) == {"float32"} and body["load_format"] == "flattened_bucket"
            nbytes = sum(4 * math.prod(shape) for shape in body["shapes"])
            got = await self._ask({"recv": nbytes})
            self.received.append((body["names"], got["sum"]))
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
        return {"success": True, "message": "ok"}


def _state(gpu: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=gpu).manual_seed(seed)
    return {f"t{i}": torch.randn(4096, device=gpu, generator=g) for i in range(8)}  # 16 KiB each


def _free_within(gpu: torch.device, limit_s: float) -> bool:
    """Whether everything queued on `gpu` finishes within `limit_s` (a thread that does not
    return is left behind: the process is failing then)."""
    done = threading.Event()

    def wait() -> None:
        torch.cuda.synchronize(gpu)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done.wait(limit_s)


def test_a_refused_nccl_broadcast_is_aborted_and_the_next_sync_rebuilds_the_group(free_port: int) -> None:
    from tether.sync.config import WeightSyncConfig
    from tether.sync.engine_control import SyncFailed
    from tether.sync.transports.distributed import DistributedTransport, flatten_bucket

    gpu = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)  # this thread's GPU is not the sender's
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    engine = Engine(proc)
    cfg = WeightSyncConfig(
        update_weight_flattened_bucket=True,
        update_weight_buffer_size=32 * 1024,  # two tensors a bucket
        update_weight_request_timeout=120.0,
        update_weight_collective_timeout=120.0,
    )
    t = DistributedTransport([engine], cfg, master_port=free_port, backend="nccl", device=gpu)

    def items(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(state.items())

    async def body() -> None:
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(SyncFailed, match=r"engine g0 .*dtype int32 is not supported"):
                await t.sync(1, items(_state(gpu, 1)))
            assert loop.time() - started < 60  # not the group's 120 s
            assert _free_within(gpu, 30), "the sender's GPU still waits on the refused broadcast"
            assert t.group is not None and not t.group.alive
            first = t.group.group_name
            engine.refuse, engine.received = None, []
            state = _state(gpu, 2)
            assert (await t.sync(1, items(state))).ok
            assert ("/destroy_weights_update_group", {"group_name": first}) in engine.calls
            assert t.group is not None and t.group.group_name != first and t.group.device == gpu
            expected = [
                (names, int(flatten_bucket([(n, state[n]) for n in names]).to(torch.int64).sum().item()))
                for names, _ in engine.received
            ]
            assert engine.received == expected and len(expected) == 4
        finally:
            await t.close()

    try:
        asyncio.run(body())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

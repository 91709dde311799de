"""RPC over ZeroMQ: round trips, arrays, typed decoding, timeouts, cancellation, bad frames."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from tether.runtime.errors import ActorDied, RemoteError, RpcTimeout
from tether.runtime.loop import run
from tether.runtime.rpc.actors import RpcServer, connect, never_suspends
from tether.runtime.rpc.secret import new_secret
from tether.runtime.rpc.wire import Codec, Kind


class Point(msgspec.Struct):
    x: int
    data: np.ndarray


class Service:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.seen: list[int] = []

    async def add(self, a: int, b: int = 0) -> int:
        return a + b

    async def shift(self, p: Point, by: int) -> Point:
        return Point(p.x + by, p.data * 2)

    async def record(self, i: int) -> None:
        self.seen.append(i)

    async def record_then_yield(self, i: int) -> None:
        self.seen.append(i)
        await asyncio.sleep(0)

    async def fail(self, text: str) -> None:
        raise KeyError(text)

    async def stats(self, arr: np.ndarray) -> dict[str, Any]:
        return {"nbytes": int(arr.nbytes), "probe": int(arr[:: 1 << 16].sum())}

    async def hang(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _private(self) -> str:
        return "secret"

    def not_async(self) -> str:
        return "sync"


def serve(address: str, body: Callable[[RpcServer, Service, bytes], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        secret = new_secret()
        target = Service()
        async with RpcServer(target, address, secret, name="svc", **kw) as server:
            await body(server, target, secret)

    run(main())


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_round_trip_structs_arrays_and_errors(transport: str, tmp_path: Path) -> None:
    address = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/svc.ipc"

    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        assert not server.address.endswith(":0")
        async with await connect(server.address, secret, name="svc", timeout=5.0) as h:
            assert await h.add(2, b=3) == 5
            assert await h.call("add", 1, 1, timeout=5.0, result_type=int) == 2
            out = await h.call(
                "shift", Point(1, np.arange(6, dtype=np.float32).reshape(2, 3)), 4, result_type=Point
            )
            assert isinstance(out, Point) and out.x == 5
            np.testing.assert_array_equal(out.data, np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
            # A plain dict that matches the annotated Struct is decoded into it on the server.
            raw = await h.shift({"x": 1, "data": np.zeros(3, np.int64)}, 1)
            assert raw["x"] == 2 and raw["data"].dtype == np.int64
            with pytest.raises(RemoteError) as err:
                await h.fail("missing-key")
            assert err.value.type_name == "KeyError"
            assert "missing-key" in err.value.message
            assert "in fail" in err.value.remote_traceback
            with pytest.raises(RemoteError, match="no public async method '_private'"):
                await h.call("_private")
            with pytest.raises(RemoteError, match="no public async method 'not_async'"):
                await h.not_async()
            with pytest.raises(RemoteError, match="argument 0"):
                await h.shift({"x": "nope", "data": np.zeros(1)}, 1)
            with pytest.raises(TypeError, match="cannot encode"):
                await h.echo(object())

    serve(address, body)


def test_timeout_and_cancellation_reach_the_server() -> None:
    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        async with await connect(server.address, secret, name="svc") as h:
            with pytest.raises(RpcTimeout, match=r"svc.hang did not answer within 0.2 s"):
                await h.call("hang", timeout=0.2)
            async with asyncio.timeout(5):
                await target.cancelled.wait()
            assert isinstance(RpcTimeout("a", "b", 1.0), TimeoutError)

            target.started.clear()
            target.cancelled.clear()
            async with asyncio.TaskGroup() as tg:
                call = tg.create_task(h.hang())
                async with asyncio.timeout(5):
                    await target.started.wait()
                call.cancel()
            async with asyncio.timeout(5):
                await target.cancelled.wait()
            assert server.in_flight == 0
            assert await h.add(1) == 1  # the connection is still fine

    serve("tcp://127.0.0.1:0", body)


def test_ten_thousand_concurrent_calls_keep_order() -> None:
    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        async with await connect(server.address, secret, name="svc") as h:
            results = await asyncio.gather(*(h.add(i, 1) for i in range(10_000)))
            assert results == [i + 1 for i in range(10_000)]
            await asyncio.gather(*(h.record(i) for i in range(2_000)))
            assert target.seen == list(range(2_000))  # one caller's calls start in send order

    serve("tcp://127.0.0.1:0", body)


def test_256_mib_frame() -> None:
    arr = np.zeros(256 << 20, dtype=np.uint8)
    arr[:: 1 << 16] = 3

    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        async with await connect(server.address, secret, name="svc") as h:
            out = await h.stats(arr, timeout=60.0)
            assert out == {"nbytes": 256 << 20, "probe": 3 * 4096}

    serve("tcp://127.0.0.1:0", body)


def test_garbage_truncated_unauthenticated_and_oversized_frames_are_dropped() -> None:
    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        good = Codec(secret)
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 5000)  # deliver everything before close
        raw.connect(server.address)
        try:
            call = good.encode(Kind.CALL, 1, "add", ((1, 2), {}))
            raw.send_multipart([b"garbage"])  # too few frames
            raw.send_multipart([b"\x93\x01", b"x" * 32])  # bad MAC
            raw.send_multipart(call[:-1])  # MAC frame cut off: too few frames
            raw.send_multipart([bytes(call[0])[:-3], call[-1]])  # truncated envelope, stale MAC
            cut = [bytes(call[0])[:-3]]
            raw.send_multipart([*cut, good.mac(cut)])  # authenticated but truncated
            junk = [b"\xc1\xc1\xc1"]
            raw.send_multipart([*junk, good.mac(junk)])  # authenticated garbage
            big = [np.ones(600 << 10, np.uint8), np.ones(600 << 10, np.uint8)]
            raw.send_multipart([*big, good.mac(big)])  # over max_message_bytes together
            bad = Codec(new_secret()).encode(Kind.CALL, 2, "add", ((1, 2), {}))
            raw.send_multipart(bad)  # another run's secret
            sealed = good.encode(Kind.CALL, 3, "stats", ((np.zeros(1 << 16, np.uint8),), {}))
            raw.send_multipart([sealed[0], np.ones(1 << 16, np.uint8), sealed[2]])  # bulk changed
        finally:
            raw.close()
            ctx.term()
        # Raw bytes that are not even ZMTP.
        host, port = server.address[len("tcp://") :].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"\xff" * 64 + b"GET / HTTP/1.0\r\n\r\n")
        async with await connect(server.address, secret, name="svc", timeout=5.0) as h:
            assert await h.add(40, 2) == 42  # still serving
            async with asyncio.timeout(5):
                while server.dropped_oversized < 1 or server.dropped_unauthenticated < 4:
                    await h.add(0)
        assert server.dropped_malformed == 4
        assert server.dropped_unauthenticated == 4
        assert server.dropped_oversized == 1
        async with await connect(server.address, new_secret(), name="svc") as stranger:
            with pytest.raises(RpcTimeout):
                await stranger.add(1, timeout=0.3)
        assert server.dropped_unauthenticated >= 5  # the call (and the cancel sent after its timeout)

    serve("tcp://127.0.0.1:0", body, max_message_bytes=1 << 20)


def test_lost_connection_fails_pending_calls() -> None:
    async def main() -> None:
        secret = new_secret()
        target = Service()
        server = RpcServer(target, "tcp://127.0.0.1:0", secret, name="svc")
        await server.__aenter__()
        async with await connect(server.address, secret, name="svc", timeout=5.0) as h:

            async def hang_until_lost() -> None:
                with pytest.raises(ActorDied, match=r"actor 'svc' is unreachable \(connection .* lost\)"):
                    await h.hang()

            async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
                tg.create_task(hang_until_lost())
                await target.started.wait()
                await server.aclose()
            with pytest.raises(ActorDied):
                await h.add(1)

    run(main())


def test_quick_methods_run_inline_and_keep_call_order() -> None:
    assert never_suspends(Service().record) and never_suspends(Service.add)
    assert not never_suspends(Service().record_then_yield) and not never_suspends(Service.hang)
    assert not never_suspends(Service().not_async)

    async def body(server: RpcServer, target: Service, secret: bytes) -> None:
        async with await connect(server.address, secret, name="svc") as h:
            # Inline (record) and task (record_then_yield) calls interleaved: they still begin
            # in the order sent, and errors from inline calls come back as RemoteError.
            await asyncio.gather(*(h.record(i) if i % 3 else h.record_then_yield(i) for i in range(3_000)))
            assert target.seen == list(range(3_000))
            with pytest.raises(RemoteError, match="KeyError"):
                await h.fail("inline")
            assert server.in_flight == 0

    serve("tcp://127.0.0.1:0", body)

"""The floors `tether bench runtime` compares tether's round trips with, each an echo process and
a client: raw blocking pyzmq (REQ/REP over TCP), which no RPC over ZeroMQ can beat; a raw blocking
Unix stream socket, which no local transport can beat; raw event-loop pyzmq (uvloop loops on both
ends watching their sockets with `add_reader`, a future per call), which no RPC served and awaited
on asyncio event loops can beat; and between the two, the same event-loop caller against the
blocking REP echo (`raw_loop_caller_pyzmq`), which no RPC awaited on an asyncio event loop can beat,
however it is served. Round trips are taken in blocks alternating with the system measured
(`interleaved_round_trips`)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

FLOORS = ("raw_pyzmq", "raw_unix_socket", "raw_loop_caller_pyzmq", "raw_loop_pyzmq")
RTT_BLOCKS = 20  # round-trip figures are taken in this many alternating blocks (see interleaved_round_trips)


_RAW_ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.REP); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    m = s.recv()
    if m == b"stop":
        s.send(b""); break
    s.send(m)
"""

# The operating system's floor: a blocking echo over a Unix stream socket, no ZeroMQ I/O
# threads in between (each ZeroMQ message crosses two of them, a thread wake-up each way).
_UNIX_ECHO = """
import os, socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); srv.bind(sys.argv[1]); srv.listen(1)
print(0, flush=True)
conn, _ = srv.accept()
while True:
    m = conn.recv(65536)
    if not m or m == b"stop":
        break
    conn.sendall(m)
"""

# The event-loop floor's echo: a ROUTER on a uvloop loop, drained on each ZMQ_FD wake-up.
_LOOP_ECHO = """
import asyncio, sys, uvloop, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
async def main():
    done = asyncio.get_running_loop().create_future()
    def drain():
        while not done.done() and s.get(zmq.EVENTS) & zmq.POLLIN:
            msg = s.recv_multipart(copy=False)
            s.send_multipart(msg, copy=False)
            if msg[-1].bytes == b"stop":
                done.set_result(None)
    asyncio.get_running_loop().add_reader(s.get(zmq.FD), drain)
    drain()
    await done
uvloop.run(main())
"""

_PAYLOAD = b"x" * 64


class Floor(Protocol):
    """A floor's client: blocking round trips to its echo process, in blocks."""

    def round_trips(self, n: int) -> list[float]: ...

    def close(self) -> None: ...


class EchoClient:
    """A blocking client of an echo process running `script` (a floor): it stays up for a whole
    repeat, so its round trips can be measured in blocks between tether's, under the same load.
    `connect(port)` returns (send, recv, close) for the client's end."""

    def __init__(self, script: str, argv: list[str], connect: Any, what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, text=True)
        try:
            assert self.proc.stdout is not None
            self._send, self._recv, self._close = connect(int(self.proc.stdout.readline()))
            self.round_trips(200)  # warm: connection set up, pages and caches touched
        except BaseException:
            self._stop_process()
            raise

    def round_trips(self, n: int) -> list[float]:
        """`n` blocking round trips of a 64-byte message, seconds each."""
        send, recv = self._send, self._recv
        times = []
        try:
            for _ in range(n):
                t = time.perf_counter()
                send(_PAYLOAD)
                recv()
                times.append(time.perf_counter() - t)
        except (TimeoutError, OSError) as exc:  # zmq.Again is an OSError too
            raise RuntimeError(
                f"the {self.what} echo process stopped answering (exit code {self.proc.poll()}): {exc}"
            ) from None
        return times

    def close(self) -> None:
        try:
            with contextlib.suppress(OSError):
                self._send(b"stop")
            self._close()
        finally:
            self._stop_process()

    def _stop_process(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def raw_pyzmq_echo() -> EchoClient:
    """Blocking REQ/REP round trips (over TCP) to an echo process: the ZeroMQ floor."""
    import zmq

    def connect(port: int) -> tuple[Any, Any, Any]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a dead echo process fails the figure, not the run
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")

        def close() -> None:
            with contextlib.suppress(zmq.ZMQError):
                sock.recv()  # the echo's answer to "stop"
            sock.close()
            ctx.term()

        return sock.send, sock.recv, close

    return EchoClient(_RAW_ECHO, [], connect, "raw pyzmq")


def raw_unix_echo(sock_dir: Path) -> EchoClient:
    """Blocking round trips over a Unix stream socket: what the OS allows without ZeroMQ."""
    import socket

    path = sock_dir / "raw-unix-echo.sock"
    path.unlink(missing_ok=True)

    def connect(_port: int) -> tuple[Any, Any, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect(str(path))

        def close() -> None:
            sock.close()
            path.unlink(missing_ok=True)

        return sock.sendall, lambda: sock.recv(65536), close

    return EchoClient(_UNIX_ECHO, [str(path)], connect, "raw Unix socket")


class LoopEchoClient:
    """The event-loop floors' client: a DEALER watched by `add_reader` on a uvloop loop of its
    own thread (the caller's loop is blocked while a floor's block runs, as for the others), one
    future per round trip, resolved by the reader; each round trip timed inside that loop.

    `served_by_loop`: the echo is a ROUTER on an event loop of its own (`raw_loop_pyzmq`); else
    the blocking REP echo of `raw_pyzmq` (`raw_loop_caller_pyzmq`), the DEALER then adding the
    empty delimiter frame that a REQ socket adds."""

    def __init__(self, served_by_loop: bool = True) -> None:
        import threading

        import uvloop
        import zmq

        script = _LOOP_ECHO if served_by_loop else _RAW_ECHO
        self.what = "raw event-loop pyzmq" if served_by_loop else "raw event-loop caller pyzmq"
        self._head: tuple[bytes, ...] = () if served_by_loop else (b"",)
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loop-floor", daemon=True)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._waiting: asyncio.Future[Any] | None = None
        try:
            assert self.proc.stdout is not None
            self._sock.connect(f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}")
            self._thread.start()
            self._on_loop(self._watch())
            self.round_trips(200)  # warm, as the other floors
        except BaseException:
            self.close()
            raise

    def _on_loop(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _watch(self) -> None:
        import zmq

        sock = self._sock
        events, pollin = zmq.EVENTS, int(zmq.POLLIN)

        def drain() -> None:
            while cast(int, sock.get(events)) & pollin:
                frame = sock.recv(copy=False)
                while frame.more:  # a REP echo's reply: the delimiter, then the payload
                    frame = sock.recv(copy=False)
                if self._waiting is not None and not self._waiting.done():
                    self._waiting.set_result(frame)

        self._drain = drain
        self._loop.add_reader(sock.get(zmq.FD), drain)

    async def _trips(self, n: int) -> list[float]:
        import zmq

        sock, loop, drain, head = self._sock, self._loop, self._drain, self._head
        events, pollin, more = zmq.EVENTS, int(zmq.POLLIN), zmq.SNDMORE
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self._waiting = fut = loop.create_future()
            for frame in head:
                sock.send(frame, more)
            sock.send(_PAYLOAD)
            if cast(int, sock.get(events)) & pollin:  # the send may have taken the edge that announced input
                drain()
            async with asyncio.timeout(10):
                await fut
            times.append(time.perf_counter() - t)
        return times

    def round_trips(self, n: int) -> list[float]:
        """`n` round trips of a 64-byte message, each awaited on the loop, seconds each."""
        try:
            return list(self._on_loop(self._trips(n)))
        except TimeoutError:
            raise RuntimeError(
                f"the {self.what} echo process stopped answering (exit code {self.proc.poll()})"
            ) from None

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self._sock.send_multipart([*self._head, b"stop"])
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
            self._sock.close()
            self._ctx.term()
            if not self._thread.is_alive():
                self._loop.close()
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@contextlib.contextmanager
def floors(sock_dir: Path) -> Iterator[dict[str, Floor]]:
    """The floors' echo processes, up for the `with` block."""
    with contextlib.ExitStack() as stack:
        out: dict[str, Floor] = {}
        starts: tuple[tuple[str, Callable[[], Floor]], ...] = (
            ("raw_pyzmq", raw_pyzmq_echo),
            ("raw_unix_socket", lambda: raw_unix_echo(sock_dir)),
            ("raw_loop_caller_pyzmq", lambda: LoopEchoClient(served_by_loop=False)),
            ("raw_loop_pyzmq", LoopEchoClient),
        )
        for name, start in starts:
            out[name] = echo = start()
            stack.callback(echo.close)
        yield out


async def interleaved_round_trips(
    own_block: Callable[[int], Awaitable[list[float]]], echoes: Mapping[str, Floor], calls: int
) -> dict[str, list[float]]:
    """`calls` round trips each of the system measured (`own_block(n)`: n round trips, seconds
    each) and of every floor, in RTT_BLOCKS alternating blocks: this machine's wake-up latency
    drifts by 2x and more from one second to the next, so the figures compared are taken in the
    same seconds. The floors block the loop while they run (nothing else is in flight then)."""
    out: dict[str, list[float]] = {"own": [], **{name: [] for name in echoes}}
    blocks = min(RTT_BLOCKS, calls)
    for b in range(blocks):
        n = calls // blocks + (1 if b < calls % blocks else 0)
        for name, echo in echoes.items():
            out[name] += echo.round_trips(n)
        out["own"] += await own_block(n)
    return out

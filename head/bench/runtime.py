"""`tether bench runtime --json`: the runtime's figures against raw pyzmq (and Ray, if installed).

Each figure is the min and median over `--repeats` runs, measured in this one run:
cold start (head plus 4 actor processes all answering), sequential RPC round trip (p50, p99),
pipelined RPC throughput, Sample-batch throughput (64 and 512 Samples of 1024 tokens: 512
prompt and 512 response tokens, with loss mask and log-probs), and two floors: a raw blocking
pyzmq round trip (REQ/REP over TCP, 64 bytes), which no RPC over ZeroMQ can beat, a raw
blocking Unix stream socket round trip, which no local transport can beat, and a raw event-loop
pyzmq round trip (`raw_loop_pyzmq`: the same 64 bytes over TCP between two uvloop event loops that
watch their sockets with `add_reader`, a future per call, no framing, no authentication), which
no RPC served and awaited on asyncio event loops, as tether's are, can beat. The floors' round
trips are taken in blocks alternating with tether's (and, in Ray's repeats, with Ray's), so each
ratio compares figures taken in the same seconds: this machine's thread wake-up latency, which
every round trip here is made of, drifts by 2x and more from one second to the next. With Ray,
`rtt_p50_ray_over_raw_pyzmq` is therefore the highest `rtt_p50_ray_over_tether` that ZeroMQ
allows on the machine at hand. Sample
batches are measured three ways:

- `samples_per_s_<n>`: the columnar frames of `tether.bench.sample_codec.encode_batch`
  (encoded once, outside the timing) through RPC; Ray gets the same frames (its numpy path).
- `full_samples_per_s_<n>`: Sample objects packed, sent and received as Samples for every
  batch (`pack_samples` → RPC → `SampleBatch`, whose receiver reads every Sample's status and
  response length; per-token lists stay undecoded until a Sample is asked for); Ray gets the
  list of Samples (pickled, as a Ray user would send them).
- `full_samples_materialized_per_s_<n>`: the same, with the receiver building every Sample
  in full (all lists decoded), as Ray's receiver does.

Batches are pipelined (all of a figure's batches in flight at once), like a rollout feeding
trainers. Ray (the `bench` extra) is imported lazily here and nowhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from tether.bench.bench_actor import offsets_frame
from tether.bench.bytecode import note_uncompiled
from tether.bench.compare import with_comparison
from tether.runtime.errors import ConfigError

if TYPE_CHECKING:
    from tether.rollout.sample import Sample

TOKENS = 1024
RESPONSE_TOKENS = 512
BATCH_SIZES = (64, 512)
ACTORS = 4
TARGETS = {  # the issues' targets on this machine (#21, restated by #37)
    "cold_start_ray_over_tether": 25.0,
    "rtt_p50_ray_over_tether": 5.0,
    "samples_64_tether_over_ray": 3.0,
    "samples_512_tether_over_ray": 3.0,
    "full_samples_64_tether_over_ray": 4.0,
    "full_samples_512_tether_over_ray": 4.0,
}
RTT_VS_RAW_PYZMQ_TARGET = 1.25
FLOORS = ("raw_pyzmq", "raw_unix_socket", "raw_loop_pyzmq")
RTT_BLOCKS = 20  # round-trip figures are taken in this many alternating blocks (see interleaved_round_trips)


def make_samples(n: int, tokens: int = TOKENS, response: int = RESPONSE_TOKENS) -> list[Sample]:
    """`n` completed Samples of `tokens` tokens, the last `response` of them the response."""
    import numpy as np

    from tether.rollout.sample import Sample, SampleStatus

    rng = np.random.default_rng(0)
    return [
        Sample(
            index=i,
            group_index=i // 8,
            rollout_id=i,
            prompt="Solve: " + "x" * 200,
            tokens=rng.integers(0, 150_000, tokens).tolist(),
            response="y" * 400,
            response_length=response,
            label="42",
            reward=1.0,
            loss_mask=[1] * response,
            rollout_log_probs=(-rng.random(response, dtype=np.float32)).tolist(),
            status=SampleStatus.COMPLETED,
            weight_versions=["3"],
        )
        for i in range(n)
    ]


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


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
    """The event-loop floor's client: a DEALER watched by `add_reader` on a uvloop loop of its
    own thread (the caller's loop is blocked while a floor's block runs, as for the others), one
    future per round trip, resolved by the reader; each round trip timed inside that loop."""

    def __init__(self) -> None:
        import threading

        import uvloop
        import zmq

        self.proc = subprocess.Popen([sys.executable, "-c", _LOOP_ECHO], stdout=subprocess.PIPE, text=True)
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
                if self._waiting is not None and not self._waiting.done():
                    self._waiting.set_result(frame)

        self._drain = drain
        self._loop.add_reader(sock.get(zmq.FD), drain)

    async def _trips(self, n: int) -> list[float]:
        import zmq

        sock, loop, drain = self._sock, self._loop, self._drain
        events, pollin = zmq.EVENTS, int(zmq.POLLIN)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self._waiting = fut = loop.create_future()
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
                f"the raw event-loop pyzmq echo process stopped answering (exit code {self.proc.poll()})"
            ) from None

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self._sock.send(b"stop")
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


def _p50_p99(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {"rtt_p50_s": times[len(times) // 2], "rtt_p99_s": times[int(len(times) * 0.99)]}


def _rounds(args: argparse.Namespace, n: int, *, full: bool = False) -> int:
    # The full path is bounded by Python-level Sample objects, so it gets a quarter of the work.
    return max(2, args.batch_rounds * 64 // n // (4 if full else 1))


async def _tether_once(
    args: argparse.Namespace, run_dir: Path, batches: dict[int, Any], echoes: Mapping[str, Floor]
) -> dict[str, Any]:
    """One repeat of every tether figure; the floors' round trips go in `out["floors"]`."""
    from tether.bench.actors import start_actor
    from tether.bench.sample_codec import pack_samples
    from tether.runtime.process.supervisor import Supervisor
    from tether.runtime.rpc.secret import new_secret

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    async with Supervisor(run_dir, new_secret(), grace=2.0) as sup:
        handles = await asyncio.gather(
            *(
                start_actor(
                    sup,
                    f"bench{i}",
                    "tether.bench.bench_actor:BenchActor",
                    heartbeat=False,
                    transport=args.transport,
                )
                for i in range(ACTORS)
            )
        )
        await asyncio.gather(*(h.echo(0) for h in handles))
        out["cold_start_s"] = time.perf_counter() - t0
        h = handles[0]
        payload = b"x" * 64
        for _ in range(200):
            await h.echo(payload)

        async def block(n: int) -> list[float]:
            times = []
            for _ in range(n):
                t = time.perf_counter()
                await h.echo(payload)
                times.append(time.perf_counter() - t)
            return times

        trips = await interleaved_round_trips(block, echoes, args.calls)
        out.update(_p50_p99(trips.pop("own")))
        out["floors"] = {name: statistics.median(t) for name, t in trips.items()}
        t = time.perf_counter()
        await asyncio.gather(*(h.echo(payload) for _ in range(args.calls)))
        out["pipelined_calls_per_s"] = args.calls / (time.perf_counter() - t)
        for n, (samples, frames) in batches.items():
            await h.take_frames(frames)
            rounds = _rounds(args, n)
            t = time.perf_counter()
            counts = await asyncio.gather(*(h.take_frames(frames) for _ in range(rounds)))
            out[f"samples_per_s_{n}"] = sum(counts) / (time.perf_counter() - t)

            for key, method in (("", "take_samples"), ("_materialized", "take_samples_materialized")):

                async def full(samples: list[Sample] = samples, method: str = method) -> int:
                    return int(await h.call(method, pack_samples(samples)))

                await full()
                t = time.perf_counter()
                counts = await asyncio.gather(*(full() for _ in range(_rounds(args, n, full=True))))
                out[f"full_samples{key}_per_s_{n}"] = sum(counts) / (time.perf_counter() - t)
    return out


def _ray_once(
    args: argparse.Namespace, batches: dict[int, Any], echoes: Mapping[str, Floor]
) -> dict[str, Any]:
    """One repeat of every Ray figure; the floors' round trips (taken between Ray's) go in
    `out["floors"]`."""
    import ray

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    ray.init(num_cpus=ACTORS, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class RayActor:
            def echo(self, value: Any) -> Any:
                return value

            def take_frames(self, frames: list[Any]) -> int:
                return len(frames[offsets_frame()]) - 1

            def take_samples(self, samples: list[Any]) -> int:
                return len(samples)

        actors = [RayActor.remote() for _ in range(ACTORS)]  # type: ignore[attr-defined]
        ray.get([a.echo.remote(0) for a in actors])
        out["cold_start_s"] = time.perf_counter() - t0
        a = actors[0]
        payload = b"x" * 64
        for _ in range(200):
            ray.get(a.echo.remote(payload))

        async def block(n: int) -> list[float]:
            times = []
            for _ in range(n):
                t = time.perf_counter()
                ray.get(a.echo.remote(payload))
                times.append(time.perf_counter() - t)
            return times

        trips = asyncio.run(interleaved_round_trips(block, echoes, args.calls))
        out.update(_p50_p99(trips.pop("own")))
        out["floors"] = {name: statistics.median(t) for name, t in trips.items()}
        t = time.perf_counter()
        ray.get([a.echo.remote(payload) for _ in range(args.calls)])
        out["pipelined_calls_per_s"] = args.calls / (time.perf_counter() - t)
        for n, (samples, frames) in batches.items():
            ray.get(a.take_frames.remote(frames))
            rounds = _rounds(args, n)
            t = time.perf_counter()
            counts = ray.get([a.take_frames.remote(frames) for _ in range(rounds)])
            out[f"samples_per_s_{n}"] = sum(counts) / (time.perf_counter() - t)
            ray.get(a.take_samples.remote(samples))
            t = time.perf_counter()
            counts = ray.get([a.take_samples.remote(samples) for _ in range(_rounds(args, n, full=True))])
            out[f"full_samples_per_s_{n}"] = sum(counts) / (time.perf_counter() - t)
    finally:
        ray.shutdown()
    return out


def _summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {key: _stats([r[key] for r in runs]) for key in runs[0]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tether.bench.sample_codec import encode_batch
    from tether.runtime.loop import run as run_loop
    from tether.runtime.process.malloc_tuning import tune_malloc

    # This process sends multi-MiB frames, as the actors receive them: it gets the actors'
    # malloc thresholds (Ray, measured in this process too, gets them as well).
    tune_malloc()

    batches = {}
    for n in BATCH_SIZES:
        samples = make_samples(n)
        batches[n] = (samples, encode_batch(samples))
    tether_runs = []
    raw: dict[str, list[float]] = {name: [] for name in FLOORS}
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for i in range(args.repeats):
            # The floors' echo processes start before tether's cold start and are measured
            # in blocks between tether's round trips: all three see the same load.
            with floors(Path(tmp)) as echoes:
                once = run_loop(_tether_once(args, Path(tmp) / f"run{i}", batches, echoes))
            for name, p50 in once.pop("floors").items():
                raw[name].append(p50)
            tether_runs.append(once)
    result: dict[str, Any] = {
        "transport": args.transport,
        "tether": _summarise(tether_runs),
        **{name: {"rtt_p50_s": _stats(raw[name])} for name in FLOORS},
        "ray": None,
        "ray_version": None,
        "ratios": {},
        "targets_met": {},
    }
    t = result["tether"]
    ratios = result["ratios"]
    ratios["rtt_p50_vs_raw_pyzmq"] = t["rtt_p50_s"]["median"] / result["raw_pyzmq"]["rtt_p50_s"]["median"]
    result["targets_met"]["rtt_p50_vs_raw_pyzmq"] = ratios["rtt_p50_vs_raw_pyzmq"] <= RTT_VS_RAW_PYZMQ_TARGET
    # What the event loops alone cost, and what tether adds on top of them.
    loop_floor = result["raw_loop_pyzmq"]["rtt_p50_s"]["median"]
    ratios["raw_loop_pyzmq_vs_raw_pyzmq"] = loop_floor / result["raw_pyzmq"]["rtt_p50_s"]["median"]
    ratios["rtt_p50_vs_raw_loop_pyzmq"] = t["rtt_p50_s"]["median"] / loop_floor
    if not args.skip_ray and importlib.util.find_spec("ray") is not None:
        ray_runs = []
        ray_floors: dict[str, list[float]] = {name: [] for name in FLOORS}
        with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
            for _ in range(args.repeats):
                with floors(Path(tmp)) as echoes:
                    once = _ray_once(args, batches, echoes)
                for name, p50 in once.pop("floors").items():
                    ray_floors[name].append(p50)
                ray_runs.append(once)
        r = result["ray"] = _summarise(ray_runs)
        result["ray_version"] = importlib.metadata.version("ray")
        # The floors as measured between Ray's round trips, for the ceilings below.
        for name, p50s in ray_floors.items():
            r[f"{name}_rtt_p50_s"] = _stats(p50s)

        def median(side: dict[str, Any], key: str) -> float:
            return float(side[key]["median"])

        ratios["cold_start_ray_over_tether"] = median(r, "cold_start_s") / median(t, "cold_start_s")
        ratios["rtt_p50_ray_over_tether"] = median(r, "rtt_p50_s") / median(t, "rtt_p50_s")
        # The ceilings of the same figure: no RPC over ZeroMQ can beat raw blocking pyzmq,
        # and nothing over a local socket can beat the raw Unix socket (each floor as measured
        # in the same seconds as Ray's round trips).
        ratios["rtt_p50_ray_over_raw_pyzmq"] = median(r, "rtt_p50_s") / median(r, "raw_pyzmq_rtt_p50_s")
        ratios["rtt_p50_ray_over_raw_unix_socket"] = median(r, "rtt_p50_s") / median(
            r, "raw_unix_socket_rtt_p50_s"
        )
        ratios["pipelined_calls_tether_over_ray"] = median(t, "pipelined_calls_per_s") / median(
            r, "pipelined_calls_per_s"
        )
        for n in BATCH_SIZES:
            ratios[f"samples_{n}_tether_over_ray"] = median(t, f"samples_per_s_{n}") / median(
                r, f"samples_per_s_{n}"
            )
            ratios[f"full_samples_{n}_tether_over_ray"] = median(t, f"full_samples_per_s_{n}") / median(
                r, f"full_samples_per_s_{n}"
            )
            ratios[f"full_samples_materialized_{n}_tether_over_ray"] = median(
                t, f"full_samples_materialized_per_s_{n}"
            ) / median(r, f"full_samples_per_s_{n}")
        for key, target in TARGETS.items():
            result["targets_met"][key] = ratios[key] >= target
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON (the default output).")
    parser.add_argument(
        "--repeats", type=int, default=3, help="Runs per figure (min and median are reported)."
    )
    parser.add_argument("--calls", type=int, default=2000, help="Calls per round-trip and throughput figure.")
    parser.add_argument(
        "--batch-rounds",
        type=int,
        default=256,
        help="Batches of 64 Samples per throughput figure (a quarter of that for the full Sample path).",
    )
    parser.add_argument(
        "--skip-ray", action="store_true", help="Do not measure Ray even when it is installed."
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "tcp", "ipc"),
        default="auto",
        help="How the actors serve (auto: ipc on this machine, as runs do; tcp to compare).",
    )


def main(args: argparse.Namespace) -> int:
    for key in ("repeats", "calls", "batch_rounds"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}", getattr(args, key), "must be at least 1")
    print(json.dumps(with_comparison(note_uncompiled(run(args), "runtime"), args), indent=2))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tether.bench.runtime")
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))

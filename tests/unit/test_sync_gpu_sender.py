"""A GPU sender of the distributed sync (NCCL), on the CPU: torch.cuda's current-device API is
replaced by a fake that keeps one current GPU per thread, 0 until a thread chooses, as CUDA
does; the process group is a stand-in whose making, abort and teardown are recorded.

- Every CUDA step of a sender (the group's making, the export, the buckets' filling, the
  broadcasts, the group's teardown) runs with the sender's own GPU current, whichever thread
  runs it: never the calling thread's GPU, never GPU 0 by default.
- An engine that refuses a bucket while the sender is held by the broadcast it never joins
  (in the broadcast, in the export queued behind it, in a streamed bucket's header) gets the
  group aborted at once: the sync raises SyncFailed naming the engine and its answer without
  waiting out the group's timeout, every engine is released, and the next sync builds a new
  group. A failing export (no engine missing) aborts nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tether.runtime.bucket_stream import STREAM_CAPABILITY, STREAM_ENDPOINT
from tether.runtime.errors import ConfigError
from tether.sync.buckets import pump as bucket_pump
from tether.sync.buckets.fill import BucketFiller
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import SyncFailed
from tether.sync.transports import distributed as transport_distributed
from tether.sync.transports.distributed import DistributedTransport, wire_device

SENDER_GPU = 3
CALLER_GPU = 5  # the thread that builds and drives the transport chose another GPU
HELD_S = 20.0  # a held step's own limit: reached only when nothing aborts the group
CPU = torch.device("cpu")


class FakeCuda:
    """One current GPU per thread, 0 until the thread chooses (CUDA's rule)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current_device(self) -> int:
        return int(getattr(self._local, "index", 0))

    def set_device(self, device: torch.device | int) -> None:
        self._local.index = device if isinstance(device, int) else device.index

    @contextmanager
    def device(self, device: torch.device | int) -> Iterator[None]:
        before = self.current_device()
        self.set_device(device)
        try:
            yield
        finally:
            self._local.index = before


class Groups:
    """Stand-ins for the weight groups' process groups: what was done to each, on which GPU."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.made: list[tuple[object, int]] = []  # (group, current GPU while it was made)
        self.aborted: list[tuple[object, int]] = []
        self.destroyed: list[tuple[object, int]] = []
        self.abort_seen = threading.Event()

    def make(self, *args: Any, **kw: Any) -> tuple[object, None]:
        pg = object()
        self.made.append((pg, self.cuda.current_device()))
        return pg, None

    def abort(self, pg: object) -> None:
        self.aborted.append((pg, self.cuda.current_device()))
        c10d._world.pg_group_ranks.pop(pg, None)  # type: ignore[call-overload]
        self.abort_seen.set()

    def destroy(self, pg: object) -> None:
        self.destroyed.append((pg, self.cuda.current_device()))
        c10d._world.pg_group_ranks.pop(pg, None)  # type: ignore[call-overload]

    def held(self) -> bool:
        """Block as a step the group's broken broadcast holds; True when an abort released it."""
        return self.abort_seen.wait(HELD_S)


class Engine:
    """Answers the sync's calls as SGLang does; refuses its `refuse`-th bucket request (0-based)
    or the streamed update, without joining the broadcast."""

    name = "e0"
    url = "http://e0"

    def __init__(self, *, stream: bool = False, refuse: int | None = None) -> None:
        self.stream, self.refuse = stream, refuse
        self.refuse_once: threading.Event | None = None
        """Set: the refusal is answered only once this is set (a late answer)."""
        self.calls: list[tuple[str, Any]] = []
        self.buckets = 0
        self.version = "0"

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        self.calls.append((path, body))
        if path == "/init_weights_update_group":
            return {"success": True, "message": "ok", STREAM_CAPABILITY: self.stream}
        if path == "/get_model_info":
            return {"weight_version": self.version}
        if path in ("/update_weights_from_distributed", STREAM_ENDPOINT):
            k, self.buckets = self.buckets, self.buckets + 1
            if k == self.refuse or (path == STREAM_ENDPOINT and self.refuse is not None):
                if self.refuse_once is not None:
                    assert await asyncio.to_thread(self.refuse_once.wait, HELD_S)
                return {"success": False, "message": "dtype int32 is not supported"}
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
        return {"success": True, "message": "ok"}

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


@pytest.fixture
def groups(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> Iterator[Groups]:
    g = Groups(cuda)
    monkeypatch.setattr(c10d, "_new_process_group_helper", g.make)
    monkeypatch.setattr(c10d, "_abort_process_group", g.abort)
    monkeypatch.setattr(dist, "destroy_process_group", g.destroy)
    yield g
    for pg, _ in g.made:
        c10d._world.pg_group_ranks.pop(pg, None)  # type: ignore[call-overload]


@pytest.fixture
def seen(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The current GPU at every fill, broadcast and streamed header, by step. The buckets are
    filled in host memory (no GPU here), by the filler's own code."""
    steps: dict[str, list[int]] = {"fill": [], "broadcast": [], "header": []}
    real_next = BucketFiller._next

    def fill(self: BucketFiller) -> Any:
        steps["fill"].append(cuda.current_device())
        wire, self._device = self._device, CPU
        try:
            return real_next(self)
        finally:
            self._device = wire

    monkeypatch.setattr(BucketFiller, "_next", fill)
    monkeypatch.setattr(
        transport_distributed, "broadcast", lambda t, src, g: steps["broadcast"].append(cuda.current_device())
    )
    monkeypatch.setattr(
        bucket_pump, "send_header", lambda g, h, d: steps["header"].append(cuda.current_device())
    )
    monkeypatch.setattr(bucket_pump, "start_broadcast", lambda b, g: [])
    monkeypatch.setattr(bucket_pump, "send_end", lambda g, d, aborted=False: None)
    return steps


def _transport(engine: Engine) -> DistributedTransport:
    cfg = WeightSyncConfig(
        update_weight_flattened_bucket=True,
        update_weight_buffer_size=64,
        update_weight_request_timeout=60.0,
        update_weight_collective_timeout=600.0,
    )
    return DistributedTransport(
        [engine], cfg, master_port=0, backend="nccl", device=torch.device("cuda", SENDER_GPU)
    )


def _export(cuda: FakeCuda, at: list[int], n: int = 8) -> Iterator[tuple[str, torch.Tensor]]:
    for i in range(n):
        at.append(cuda.current_device())
        yield f"t{i}", torch.full((8,), float(i))  # 32 bytes: two per bucket


def test_an_nccl_sender_must_name_its_gpu() -> None:
    with pytest.raises(ConfigError, match="device"):
        wire_device("nccl")
    with pytest.raises(ConfigError, match="device"):
        wire_device("nccl", torch.device("cuda"))  # no index: whichever GPU is current
    with pytest.raises(ConfigError, match="device"):
        wire_device("gloo", torch.device("cuda", 0))
    assert wire_device("nccl", torch.device("cuda", 2)) == torch.device("cuda", 2)
    assert wire_device("gloo") == CPU


@pytest.mark.parametrize("stream", [False, True], ids=["per-bucket", "streamed"])
def test_every_step_runs_on_the_senders_gpu_whichever_thread_runs_it(
    cuda: FakeCuda, groups: Groups, seen: dict[str, list[int]], stream: bool
) -> None:
    cuda.set_device(CALLER_GPU)
    engine = Engine(stream=stream)
    t = _transport(engine)
    exported: list[int] = []

    async def body() -> None:
        try:
            entry = await t.sync(1, _export(cuda, exported))
            assert entry.ok
            assert t.group is not None and t.group.device == torch.device("cuda", SENDER_GPU)
            # The flattened buckets' buffers do not outlive the sync on a GPU sender.
            assert t._flat == [None, None]
        finally:
            await t.close()

    asyncio.run(body())
    assert cuda.current_device() == CALLER_GPU
    assert exported and set(exported) == {SENDER_GPU}
    assert seen["fill"] and set(seen["fill"]) == {SENDER_GPU}
    sent = seen["header"] if stream else seen["broadcast"]
    assert len(sent) == 4 and set(sent) == {SENDER_GPU}
    assert [gpu for _, gpu in groups.made] == [SENDER_GPU]
    assert [gpu for _, gpu in groups.destroyed] == [SENDER_GPU]
    assert not groups.aborted


def test_a_cpu_sender_keeps_its_flat_buffers_between_syncs() -> None:
    t = DistributedTransport([], WeightSyncConfig(update_weight_flattened_bucket=True), master_port=1)
    t._flat = [torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)]
    t._release_buffers()
    assert all(b is not None for b in t._flat)


def _hold_in_broadcast(groups: Groups, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Bucket 1's broadcast never completes until the group is aborted (a peer never joins)."""
    released: list[bool] = []
    count = [0]

    def broadcast(t: torch.Tensor, src: int, g: object) -> None:
        count[0] += 1
        if count[0] == 2:
            released.append(groups.held())

    monkeypatch.setattr(transport_distributed, "broadcast", broadcast)
    return released


def _hold_in_export(
    cuda: FakeCuda, groups: Groups, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> tuple[Iterator[tuple[str, torch.Tensor]], list[bool]]:
    """The export for bucket 2 waits for bucket 1's broadcast, never completed (as a GPU copy
    queued behind it), while bucket 1's own broadcast call returns (as NCCL's does once queued).
    The engine refuses bucket 1 late: once that call has returned and the export is held, so
    only a sender that watches the engines while it waits for the export sees the refusal.
    (The filler pulls tensor 6, which ends bucket 2, once bucket 1 is on the wire.)"""
    released: list[bool] = []
    returned, held = threading.Event(), threading.Event()
    count = [0]

    def broadcast(t: torch.Tensor, src: int, g: object) -> None:
        count[0] += 1
        if count[0] == 2:
            returned.set()

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(_export(cuda, [])):
            if i == 6:
                assert returned.wait(HELD_S)
                held.set()
                released.append(groups.held())
            yield item

    monkeypatch.setattr(transport_distributed, "broadcast", broadcast)
    engine.refuse_once = held
    return export(), released


def _hold_in_header(groups: Groups, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    released: list[bool] = []
    monkeypatch.setattr(bucket_pump, "send_header", lambda g, h, d: released.append(groups.held()))
    return released


@pytest.mark.parametrize("held", ["broadcast", "export", "stream-header"])
def test_a_refused_bucket_aborts_the_group_and_the_next_sync_builds_a_new_one(
    cuda: FakeCuda, groups: Groups, seen: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    cuda.set_device(CALLER_GPU)
    # Per bucket: bucket 1 is refused; streamed: the one request is.
    engine = Engine(stream=held == "stream-header", refuse=0 if held == "stream-header" else 1)
    t = _transport(engine)
    tensors = _export(cuda, [])
    if held == "broadcast":
        released = _hold_in_broadcast(groups, monkeypatch)
    elif held == "stream-header":
        released = _hold_in_header(groups, monkeypatch)
    else:
        tensors, released = _hold_in_export(cuda, groups, engine, monkeypatch)

    async def body() -> None:
        try:
            with pytest.raises(SyncFailed, match=r"engine e0 .*dtype int32 is not supported"):
                await t.sync(1, tensors)
            first = t.group
            assert first is not None and not first.alive  # aborted now, not at the next sync
            assert engine.version == "0"
            assert engine.paths()[-2:] == ["/end_weight_update", "/continue_generation"]
            # The next sync tells the engine to drop the aborted group and builds a new one.
            engine.refuse, engine.calls = None, []
            monkeypatch.setattr(transport_distributed, "broadcast", lambda t, src, g: None)
            monkeypatch.setattr(bucket_pump, "send_header", lambda g, h, d: None)
            assert (await t.sync(1, _export(cuda, []))).ok
            assert t.group is not None and t.group.group_name != first.group_name
            assert ("/destroy_weights_update_group", {"group_name": first.group_name}) in engine.calls
        finally:
            await t.close()

    asyncio.run(body())
    # The held step was let go by the abort, not by its own limit (a stream's pump may send
    # on after it, unheld, until it sees the sync stopped).
    assert released and all(released)
    assert len(groups.made) == 2
    assert [gpu for _, gpu in groups.aborted] == [SENDER_GPU]
    assert groups.aborted[0][0] is groups.made[0][0]


def test_a_failing_export_aborts_nothing(cuda: FakeCuda, groups: Groups, seen: dict[str, list[int]]) -> None:
    """The engines took every bucket sent (or the stream's ABORT): the group is rebuilt at the
    next sync as after any failure, but nothing pending needs ending."""
    engine = Engine()
    t = _transport(engine)

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        yield from _export(cuda, [], 4)
        raise RuntimeError("conversion failed")

    async def body() -> None:
        try:
            with pytest.raises(RuntimeError, match="conversion failed"):
                await t.sync(1, export())
            assert t.group is not None and t.group.alive
            assert (await t.sync(1, _export(cuda, []))).ok
        finally:
            await t.close()

    asyncio.run(body())
    assert not groups.aborted
    assert len(groups.made) == 2 and len(groups.destroyed) == 2

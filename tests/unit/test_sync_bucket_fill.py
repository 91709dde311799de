"""The distributed sync's bucket filler (tether.sync.buckets.fill) and the sender's overlap of the
export of bucket k+1 with the broadcast of bucket k, with no process and no engine: the bytes
each bucket would put on the wire equal the tensors' bytes, in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tether.sync.buckets.fill import BucketFiller
from tether.sync.config import WeightSyncConfig
from tether.sync.transports.distributed import DistributedTransport, flatten_bucket

CPU = torch.device("cpu")


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: an fp32 next would sit at 6
        ("b", torch.randn(2, 4, generator=g).t()),  # not contiguous: copied by strides
        ("c", torch.tensor([True, False, True])),
        ("d", torch.randn(4, generator=g).to(torch.bfloat16)),
        ("e", torch.randn(100, generator=g)),  # 400 bytes: larger than any limit, goes alone
        ("f", torch.tensor(2.5)),  # 0-dim
        ("g", torch.zeros(0)),
        ("h", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]


def _all(filler: BucketFiller) -> list[Any]:
    out = []
    while (b := filler.next()) is not None:
        out.append(b)
    return out


def test_a_buffer_size_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="update_weight_buffer_size=0"):
        BucketFiller([], 0, CPU, flattened=True, buffers=[None, None])


@pytest.mark.parametrize("flattened", [True, False])
def test_buckets_carry_every_tensor_once_in_order_with_their_bytes(flattened: bool) -> None:
    named = _named()
    buffers: list[torch.Tensor | None] = [None, None]
    got = _all(BucketFiller(named, 48, CPU, flattened=flattened, buffers=buffers))
    assert [n for b in got for n, _ in b.tensors] == [n for n, _ in named]
    assert [b.number for b in got] == list(range(len(got)))
    assert [b.last for b in got] == [False] * (len(got) - 1) + [True]
    assert len(got) >= 3  # several buckets, some of several tensors
    assert any(len(b.tensors) > 1 for b in got)
    for b in got:
        assert b.nbytes <= 48 or len(b.tensors) == 1
        originals = dict(named)
        for name, sent in b.tensors:
            orig = originals[name]
            assert sent.dtype == orig.dtype and sent.shape == orig.shape and torch.equal(sent, orig), name
        if not flattened:
            assert b.flat is None and all(t.is_contiguous() for _, t in b.tensors)
            continue
        # The flat bytes are the tensors' bytes in order, each at an offset its size divides.
        assert b.flat is not None and b.flat.dtype == torch.uint8 and b.flat.numel() == b.nbytes
        assert torch.equal(b.flat, flatten_bucket([(n, t.contiguous()) for n, t in b.tensors]))
        offset = 0
        for _, t in b.tensors:
            assert offset % t.element_size() == 0
            offset += t.numel() * t.element_size()


def test_a_lone_tensor_is_sent_from_its_own_bytes_and_buffers_are_kept() -> None:
    big = torch.randn(100)
    small = [(f"s{i}", torch.full((4,), float(i))) for i in range(4)]
    buffers: list[torch.Tensor | None] = [None, None]

    def one_sync() -> list[Any]:
        return _all(BucketFiller([("big", big), *small], 32, CPU, flattened=True, buffers=buffers))

    first = one_sync()
    assert [len(b.tensors) for b in first] == [1, 2, 2]
    assert first[0].flat.data_ptr() == big.data_ptr()  # no copy at all
    kept = [b.data_ptr() for b in buffers if b is not None]
    assert len(kept) == 2
    # The two buffers are used in turn: bucket 1 in one, bucket 2 in the other.
    assert {first[1].flat.data_ptr(), first[2].flat.data_ptr()} == set(kept)
    second = one_sync()
    assert [b.data_ptr() for b in buffers if b is not None] == kept  # no fresh pages next sync
    assert [b.flat.data_ptr() for b in second[1:]] == [b.flat.data_ptr() for b in first[1:]]
    assert all(torch.equal(b.flat, flatten_bucket(b.tensors)) for b in second)


class _Engine:
    """Answers every control call with success; records the bucket requests."""

    name = url = "fake"

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if path == "/update_weights_from_distributed":
            self.bodies.append(body)
        return {"success": True}


class _Group:
    group_name = "fake-group"


def test_the_export_of_the_next_bucket_runs_while_this_one_is_on_the_wire() -> None:
    """Each bucket's broadcast returns only once the export has produced a tensor of the next
    bucket: a sender that exported only after the broadcast would time out here."""
    changed = threading.Condition()
    on_wire: set[int] = set()  # buckets whose broadcast is in progress
    overlapped: set[int] = set()  # buckets during whose broadcast the export went on
    per_bucket = 16 * 1024**2 // 4  # 16 MiB: each tensor fills a bucket alone
    names = [f"t{i}" for i in range(4)]
    sent: list[tuple[list[str], bytes]] = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(names):
            if i >= 2:
                # Tensor i belongs to bucket i, exported one bucket ahead (its predecessor is
                # carried): only once bucket i-2 is on the wire, which a sender that exports
                # before broadcasting never reaches.
                with changed:
                    assert changed.wait_for(lambda b=i - 2: b in on_wire, timeout=20), "export not overlapped"
                    overlapped.add(i - 2)
                    changed.notify_all()
            yield name, torch.full((per_bucket,), float(i))

    def broadcast(bucket: list[tuple[str, torch.Tensor]], flat: torch.Tensor | None) -> None:
        assert flat is not None
        k = len(sent)
        sent.append(([n for n, _ in bucket], flat[:8].clone().numpy().tobytes()))
        with changed:
            on_wire.add(k)
            changed.notify_all()
            if k + 2 < len(names):
                assert changed.wait_for(lambda: k in overlapped, timeout=20), "export not overlapped"
            on_wire.discard(k)

    cfg = WeightSyncConfig(update_weight_flattened_bucket=True, update_weight_buffer_size=16 * 1024**2)
    engine = _Engine()
    t = DistributedTransport([engine], cfg, master_port=1)
    t.group = _Group()  # type: ignore[assignment]
    t._broadcast_bucket = broadcast  # type: ignore[method-assign]
    moved = asyncio.run(t._send(7, export()))
    assert moved == 4 * per_bucket * 4
    assert [n for n, _ in sent] == [[n] for n in names]
    assert [b[:8] for _, b in sent] == [torch.full((2,), float(i)).numpy().tobytes() for i in range(4)]
    assert [b["names"] for b in engine.bodies] == [[n] for n in names]
    assert [b.get("weight_version") for b in engine.bodies] == [None, None, None, "7"]
    assert all(b["load_format"] == "flattened_bucket" for b in engine.bodies)


def test_a_failed_broadcast_leaves_no_export_running() -> None:
    """After a failure the sender returns only once the filling thread is done, so the caller
    can drain the stream without two threads advancing it."""
    pulled = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(50):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4 * 1024**2)  # 16 MiB each: one per bucket

    def broadcast(bucket: list[tuple[str, torch.Tensor]], flat: torch.Tensor | None) -> None:
        raise RuntimeError("the wire broke")

    cfg = WeightSyncConfig(update_weight_buffer_size=16 * 1024**2)
    t = DistributedTransport([_Engine()], cfg, master_port=1)
    t.group = _Group()  # type: ignore[assignment]
    t._broadcast_bucket = broadcast  # type: ignore[method-assign]
    stream = export()
    with pytest.raises(RuntimeError, match="the wire broke"):
        asyncio.run(t._send(1, stream))
    before = len(pulled)
    assert before <= 3  # bucket 0, bucket 1 (filled during the broadcast) and its carry
    rest = list(stream)  # no "generator already executing": nothing else advances it now
    assert len(rest) == 50 - before

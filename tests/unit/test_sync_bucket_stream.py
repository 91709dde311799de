"""The streamed distributed update (tether.runtime.bucket_stream): the sender's BucketPump and
the CPU engine's receive_stream over a real two-rank gloo group, both ranks in this process
(one thread each): every byte arrives where it belongs, a refused bucket or a failed export
ends the update cleanly, and the group stays usable after either."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tether.rollout.cpu_engine.http.sglang_api import parse_dtype
from tether.rollout.cpu_engine.modeling import tiny_model
from tether.rollout.cpu_engine.modeling.model import ModelConfig, TinyLM, WeightMismatch, read_safetensors_dir
from tether.rollout.cpu_engine.weights.receive import BucketReceiver
from tether.rollout.cpu_engine.weights.receive_stream import receive_stream
from tether.runtime.bucket_stream import StreamAborted, recv_header
from tether.runtime.weight_group import WeightGroup, broadcast
from tether.sync.buckets.fill import BucketFiller
from tether.sync.buckets.pump import BucketPump, PumpStopped

CPU = torch.device("cpu")


@pytest.fixture
def pair() -> Iterator[tuple[WeightGroup, WeightGroup]]:
    """Rank 0 and rank 1 of one gloo group, both in this process."""
    store = dist.PrefixStore("stream-test", dist.HashStore())
    made: list[Any] = [None, None]

    def make(rank: int) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        made[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pg in made:
        c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}
    yield WeightGroup("stream-test", 0, 2, "gloo", made[0]), WeightGroup("stream-test", 1, 2, "gloo", made[1])
    for pg in made:
        c10d._world.pg_group_ranks.pop(pg, None)


def _on_rank1(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # reported to the test
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, out


def _still_in_step(pair: tuple[WeightGroup, WeightGroup]) -> None:
    """A plain broadcast after the stream still pairs up (the group is usable)."""
    got = torch.zeros(5)
    t, _ = _on_rank1(lambda: broadcast(got, 0, pair[1]))
    broadcast(torch.arange(5.0), 0, pair[0])
    t.join(30)
    assert torch.equal(got, torch.arange(5.0))


def _pump(
    tensors: list[tuple[str, torch.Tensor]], limit: int, flattened: bool, pack: bool, g: WeightGroup
) -> BucketPump:
    filler = BucketFiller(iter(tensors), limit, CPU, flattened=flattened, buffers=[None, None], pack=pack)
    return BucketPump(filler, g, CPU)


@pytest.mark.parametrize(("flattened", "pack"), [(False, True), (True, False), (True, True)])
def test_every_bucket_arrives_after_its_header_byte_for_byte(
    pair: tuple[WeightGroup, WeightGroup], flattened: bool, pack: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    sent = [
        (f"w{i}", torch.randn(shape, generator=g).to(dtype))
        for i, (shape, dtype) in enumerate(
            [
                ((64, 32), torch.float32),
                ((7,), torch.bfloat16),
                ((33, 5), torch.float32),
                ((100,), torch.bfloat16),
            ]
        )
    ]
    total = sum(t.numel() * t.element_size() for _, t in sent)

    def receive() -> list[tuple[str, str, list[int], bytes]]:
        got = []
        while (header := recv_header(pair[1], CPU)) is not None:
            sizes = [
                getattr(torch, d).itemsize * int(torch.Size(s).numel())
                for d, s in zip(header.dtypes, header.shapes, strict=True)
            ]
            if flattened and pack and len(sizes) > 1:  # one packed buffer on the wire
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
                broadcast(buf, 0, pair[1])
                parts = list(torch.split(buf, sizes))
            else:
                parts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
                for p in parts:
                    broadcast(p, 0, pair[1])
            for name, d, s, p in zip(header.names, header.dtypes, header.shapes, parts, strict=True):
                got.append((name, d, s, p.numpy().tobytes()))
        return got

    t, out = _on_rank1(receive)
    moved = _pump(sent, 12_000, flattened, pack, pair[0]).run()
    t.join(30)
    assert "error" not in out, out
    assert moved == total
    assert out["value"] == [
        (
            n,
            str(x.dtype).removeprefix("torch."),
            list(x.shape),
            x.view(-1).view(torch.uint8).numpy().tobytes(),
        )
        for n, x in sent
    ]
    _still_in_step(pair)


def _engine_model(tmp_path: Path) -> TinyLM:
    out = tmp_path / "model"
    tiny_model.write_tiny_model(out, tiny_model.TinyModelSpec())
    return TinyLM(ModelConfig.from_dir(out), read_safetensors_dir(out))


@pytest.mark.parametrize("flattened", [False, True])
def test_the_engine_loads_a_streamed_sync_into_its_parameters(
    pair: tuple[WeightGroup, WeightGroup], tmp_path: Path, flattened: bool
) -> None:
    model = _engine_model(tmp_path)
    receiver = BucketReceiver()
    for step in (1, 2):  # the second sync lands in the buffers the first one left
        new = [(n, p.detach() + step) for n, p in model.params.items()]
        t, out = _on_rank1(lambda: receive_stream(receiver, model, pair[1], flattened, parse_dtype))
        pump = _pump(new, 20_000, flattened, False, pair[0])
        moved = pump.run()
        t.join(30)
        assert "error" not in out, out
        assert out["value"] > 3  # several buckets, each read from its header
        assert moved == sum(x.numel() * x.element_size() for _, x in new)
        for name, x in new:
            assert torch.equal(model.params[name], x), name


def test_a_refused_bucket_drains_the_rest_and_loads_none_of_them(
    pair: tuple[WeightGroup, WeightGroup], tmp_path: Path
) -> None:
    model = _engine_model(tmp_path)
    before = {n: p.clone() for n, p in model.params.items()}
    new = [(n, p.detach() + 1) for n, p in model.params.items()]
    poisoned = len(new) // 2
    new[poisoned][1].view(-1)[0] = float("nan")
    t, out = _on_rank1(lambda: receive_stream(BucketReceiver(), model, pair[1], True, parse_dtype))
    _pump(new, 1, True, False, pair[0]).run()  # one tensor per bucket
    t.join(30)
    assert isinstance(out.get("error"), WeightMismatch)
    assert f"bucket {poisoned + 1}:" in str(out["error"]) and "NaN or inf" in str(out["error"])
    for i, (name, x) in enumerate(new):  # loaded before the refusal, untouched from it on
        assert torch.equal(model.params[name], x if i < poisoned else before[name]), name
    _still_in_step(pair)


def test_a_refused_dtype_is_drained_by_its_size(
    pair: tuple[WeightGroup, WeightGroup], tmp_path: Path
) -> None:
    model = _engine_model(tmp_path)
    new = [(n, p.detach() + 1) for n, p in model.params.items()]
    name, x = new[0]
    new[0] = (name, x.to(torch.int32))
    t, out = _on_rank1(lambda: receive_stream(BucketReceiver(), model, pair[1], False, parse_dtype))
    _pump(new, 20_000, False, True, pair[0]).run()
    t.join(30)
    assert "int32" in str(out.get("error"))
    _still_in_step(pair)


def test_a_failed_export_aborts_the_stream_and_keeps_the_group(
    pair: tuple[WeightGroup, WeightGroup], tmp_path: Path
) -> None:
    model = _engine_model(tmp_path)
    names = list(model.params)

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names[:3]:
            yield name, model.params[name].detach().clone()
        raise RuntimeError("the export broke")

    t, out = _on_rank1(lambda: receive_stream(BucketReceiver(), model, pair[1], False, parse_dtype))
    filler = BucketFiller(export(), 1, CPU, flattened=False, buffers=[None, None])
    with pytest.raises(RuntimeError, match="the export broke"):
        BucketPump(filler, pair[0], CPU).run()
    t.join(30)
    assert isinstance(out.get("error"), WeightMismatch)
    assert "before its last bucket" in str(out["error"])
    _still_in_step(pair)


def test_a_stopped_pump_advances_no_export_and_tells_the_receivers(
    pair: tuple[WeightGroup, WeightGroup],
) -> None:
    pulled = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(10):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)

    t, out = _on_rank1(lambda: recv_header(pair[1], CPU))
    stream = export()
    pump = BucketPump(BucketFiller(stream, 1, CPU, flattened=False, buffers=[None, None]), pair[0], CPU)
    pump.stop()
    with pytest.raises(PumpStopped):
        pump.run()
    t.join(30)
    assert isinstance(out.get("error"), StreamAborted)
    assert pulled == [] and len(list(stream)) == 10  # the caller drains it alone
    _still_in_step(pair)

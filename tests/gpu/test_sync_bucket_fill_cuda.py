"""The distributed sync's bucket filler on a GPU sender (NCCL): flat buffers live on the
sender's GPU, tensors from the host or the GPU (any strides) land in them byte for byte, a lone
GPU tensor is sent from its own memory; a sender runs every step on the GPU it was given, never
on a thread's current one, and frees its buffers after each sync. Skipped without CUDA."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_flat_buckets_fill_on_the_gpu_from_host_and_gpu_tensors() -> None:
    from tether.sync.buckets.fill import BucketFiller
    from tether.sync.transports.distributed import flatten_bucket, wire_device

    device = wire_device("nccl", torch.device("cuda", 0))
    named = [
        ("host", torch.arange(6, dtype=torch.float32)),
        ("gpu_t", torch.randn(4, 2, device=device).to(torch.bfloat16).t()),  # not contiguous
        ("mask", torch.tensor([True, False], device=device)),
        ("big", torch.randn(1000, device=device)),  # over the limit: alone
    ]
    buffers: list[torch.Tensor | None] = [None, None]
    filler = BucketFiller(named, 64, device, flattened=True, buffers=buffers)
    got = []
    while (b := filler.next()) is not None:
        got.append(b)
    assert [[n for n, _ in b.tensors] for b in got] == [["host", "gpu_t", "mask"], ["big"]]
    for b in got:
        assert b.flat is not None and b.flat.device == device
        expected = flatten_bucket([(n, dict(named)[n].to(device).contiguous()) for n, _ in b.tensors])
        assert torch.equal(b.flat, expected)
    assert got[1].flat is not None and got[1].flat.data_ptr() == named[3][1].data_ptr()  # no copy


def _tether_callers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where tether's own code asks torch for the calling thread's current GPU (it must not:
    a worker thread's is 0 whatever GPU the rank chose). torch's own calls go through."""
    real = torch.cuda.current_device
    callers: list[str] = []

    def current_device() -> int:
        caller = sys._getframe(1)
        module = str(caller.f_globals.get("__name__", ""))
        if module.startswith("tether."):
            callers.append(f"{module}:{caller.f_lineno}")
        return real()

    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    return callers


def test_a_gpu_sender_names_its_gpu_and_frees_its_buffers_after_each_sync(
    monkeypatch: pytest.MonkeyPatch, free_port: int
) -> None:
    """A real one-rank NCCL weight group (one GPU suffices): the sender records the GPU it was
    given, every step runs there without asking any thread which GPU is current, the export and
    the broadcasts see it current, and the flattened buckets' buffers are freed when each sync
    ends."""
    from tether.sync.config import WeightSyncConfig
    from tether.sync.transports import distributed as transport_distributed
    from tether.sync.transports.distributed import DistributedTransport

    gpu = torch.device("cuda", torch.cuda.device_count() - 1)  # the last GPU: not 0 where there are two
    callers = _tether_callers(monkeypatch)
    sent: list[tuple[torch.device, int]] = []  # (the flat bucket's device, the sending thread's GPU)
    real_broadcast = transport_distributed.broadcast

    def broadcast(flat: torch.Tensor, src: int, group: object) -> None:
        sent.append((flat.device, torch._C._cuda_getDevice()))
        real_broadcast(flat, src, group)  # type: ignore[arg-type]

    monkeypatch.setattr(transport_distributed, "broadcast", broadcast)
    named = [(f"t{i}", torch.full((1024,), float(i), device=gpu)) for i in range(8)]  # 4 KiB each
    exported: list[int] = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for item in named:
            exported.append(torch._C._cuda_getDevice())  # this thread's GPU, asked of CUDA itself
            yield item

    cfg = WeightSyncConfig(
        update_weight_flattened_bucket=True,
        update_weight_buffer_size=8 * 1024,  # two tensors a bucket: four flat buckets
        update_weight_collective_timeout=120.0,
    )
    # No engine: the group is this process alone. Per-bucket requests, so buckets are packed.
    t = DistributedTransport([], cfg, master_port=free_port, backend="nccl", device=gpu, stream_buckets=False)

    async def body() -> None:
        try:
            for version in (1, 2, 3):
                before = torch.cuda.memory_allocated(gpu)
                assert (await t.sync(version, export())).ok
                assert t.group is not None and t.group.device == gpu
                assert t._flat == [None, None]
                torch.cuda.synchronize(gpu)
                gc.collect()  # what a reference cycle among the sync's tasks held goes too
                if version > 1:  # the first sync also made the communicator
                    assert torch.cuda.memory_allocated(gpu) == before  # no sync memory kept
        finally:
            await t.close()

    asyncio.run(body())
    assert t.device == gpu
    assert not callers, f"tether asked for the current GPU at {callers}"
    assert exported and set(exported) == {gpu.index}
    assert len(sent) == 12 and set(sent) == {(gpu, gpu.index)}  # four flat buckets a sync

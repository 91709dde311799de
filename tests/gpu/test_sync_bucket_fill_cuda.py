"""The distributed sync's bucket filler on a GPU sender (NCCL): flat buffers live on the current
GPU, tensors from the host or the GPU (any strides) land in them byte for byte, a lone GPU
tensor is sent from its own memory, and the sender's filling thread runs with the sender's GPU
current. Skipped without CUDA."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_flat_buckets_fill_on_the_gpu_from_host_and_gpu_tensors() -> None:
    from tether.sync.bucket_fill import BucketFiller
    from tether.sync.transport_distributed import flatten_bucket, wire_device

    device = wire_device("nccl")
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


def test_the_filling_thread_runs_with_the_senders_gpu_current() -> None:
    from tether.sync.config import WeightSyncConfig
    from tether.sync.transport_distributed import DistributedTransport

    seen: list[int] = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(3):
            seen.append(torch.cuda.current_device())
            yield f"t{i}", torch.full((4,), float(i), device="cuda")

    class Engine:
        name = url = "fake"

        async def request(self, method: str, path: str, body: object = None, **kw: object) -> object:
            return {"success": True}

    class Group:
        group_name = "g"

    sent: list[torch.Tensor] = []
    t = DistributedTransport([Engine()], WeightSyncConfig(update_weight_flattened_bucket=True), master_port=1)
    t.device = torch.device("cuda", torch.cuda.current_device())
    t.group = Group()  # type: ignore[assignment]
    t._broadcast_bucket = lambda bucket, flat: sent.append(flat.clone())  # type: ignore[method-assign,union-attr]
    assert asyncio.run(t._send(1, export())) == 3 * 16
    assert seen == [t.device.index] * 3
    assert len(sent) == 1 and sent[0].device == t.device

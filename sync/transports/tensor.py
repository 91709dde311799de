"""Colocated sync (--colocate): tensors pass as shared-memory handles through /update_weights_from_tensor.

Trainer and engines share the devices. A CUDA IPC handle names its GPU (by UUID), and an engine
rank can open only a handle of a GPU it sees, so every trainer rank shares its own device's copy
of each bucket and the handles are routed: engine TP rank i gets the entry of the trainer rank
on the same device (`route_handles`; the plan says which rank that is, see
tether.placement.colocation). On CPU the handles are shared-memory names and the same routing
runs. One bucket, on every trainer rank (`rank_handle_buckets`, a collective):

    share the bucket on this rank's device → serialise one entry per engine rank it serves
    → gather every rank's entries to the posting rank → (it posts them to the engines)
    → barrier → free the copies

The memory order around a sync is the head's (tether.rollout.engine_api.memory): the engines'
weights are resumed before the sync and their generation memory after it; the transport resumes
and releases nothing itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tether.sync.buckets.grouping import buckets, nbytes, with_last
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import EngineEndpoint, SyncFailed, call, confirmed_entry, on_all, paused
from tether.sync.ledger import LedgerEntry

Named = list[tuple[str, torch.Tensor]]
Gather = Callable[[list[str]], list[list[str]] | None]
"""Every trainer rank's entries, by rank, on the posting rank (None on the others)."""


class Encoder(Protocol):
    """The engine side's payload format (tether.rollout.engine_api.weights)."""

    def share(self, named: Named) -> Named:
        """Copies another process can open; they must outlive the engines' answers."""
        ...

    def serialize(self, shared: Named) -> str:
        """One engine rank's serialized_named_tensors entry."""
        ...


class _EngineWeights:
    def share(self, named: Named) -> Named:
        from tether.rollout.engine_api.weights import share_named_tensors

        return share_named_tensors(named)

    def serialize(self, shared: Named) -> str:
        from tether.rollout.engine_api.weights import serialize_named_tensors

        return serialize_named_tensors(shared)


@dataclass
class HandleBucket:
    """One bucket as the engines get it: per engine, one entry per TP rank, in rank order."""

    payloads: list[list[str]]
    nbytes: int
    last: bool


def handles_served(sources: Sequence[Sequence[int]], rank: int) -> int:
    """How many engine ranks take their entry from trainer rank `rank`."""
    return sum(row.count(rank) for row in sources)


def route_handles(gathered: Sequence[Sequence[str]], sources: Sequence[Sequence[int]]) -> list[list[str]]:
    """Each engine's serialized_named_tensors: TP rank i's entry comes from trainer rank
    `sources[engine][i]`, the rank on that engine rank's device (a rank serving several engine
    ranks gave one entry for each, used in order)."""
    used = [0] * len(gathered)
    routed: list[list[str]] = []
    for engine, row in enumerate(sources):
        entries = []
        for tp_rank, rank in enumerate(row):
            if not 0 <= rank < len(gathered) or used[rank] >= len(gathered[rank]):
                raise SyncFailed(
                    f"engine {engine} TP rank {tp_rank}: trainer rank {rank} sent no handle for it "
                    f"({len(gathered)} ranks answered)"
                )
            entries.append(gathered[rank][used[rank]])
            used[rank] += 1
        routed.append(entries)
    return routed


def rank_handle_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    buffer_size: int,
    *,
    rank: int,
    sources: Sequence[Sequence[int]],
    gather: Gather,
    barrier: Callable[[], None],
    encode: Encoder | None = None,
) -> Iterator[HandleBucket | None]:
    """One trainer rank's part of a colocated sync, bucket by bucket (every rank runs it, in
    step: each bucket is a gather and a barrier). On the posting rank each item is the bucket's
    routed payloads, else None. Asking for the next item means the engines answered this one:
    the barrier then lets every rank free its copies."""
    encoder = encode or _EngineWeights()
    served = handles_served(sources, rank)
    for bucket, last in with_last(buckets(tensors, buffer_size)):
        shared = encoder.share(bucket) if served else []
        # One entry per engine rank: SGLang opens each CUDA payload once per rank (IPC refcounts).
        gathered = gather([encoder.serialize(shared) for _ in range(served)])
        yield (
            None
            if gathered is None
            else HandleBucket(route_handles(gathered, sources), sum(nbytes(t) for _, t in bucket), last)
        )
        barrier()
        del shared
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the engines closed their handles: the copies' blocks are free


async def local_handle_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]],
    buffer_size: int,
    engine_ranks: Sequence[int],
    encode: Encoder | None = None,
) -> AsyncIterator[HandleBucket]:
    """One process holds every tensor and serves every engine rank (a bench, a test)."""
    sources = [[0] * ranks for ranks in engine_ranks]
    steps = rank_handle_buckets(
        tensors,
        buffer_size,
        rank=0,
        sources=sources,
        gather=lambda mine: [mine],
        barrier=lambda: None,
        encode=encode,
    )
    while (item := await asyncio.to_thread(next, steps, None)) is not None:
        yield item


class TensorTransport:
    """The colocated transport: no disk, no broadcast; handles to tensors the trainer keeps alive."""

    name = "tensor"

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        cfg: WeightSyncConfig,
        *,
        encode: Encoder | None = None,
        engine_ranks: Sequence[int] | None = None,
    ) -> None:
        self.engines = list(engines)
        self.cfg = cfg
        self.encode: Encoder = encode or _EngineWeights()
        self.engine_ranks = list(engine_ranks or [1] * len(self.engines))

    async def _post(self, engine: EngineEndpoint, payloads: list[str], version: int | None) -> None:
        body: dict[str, object] = {
            "serialized_named_tensors": payloads,
            "load_format": None,
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = str(version)
        answer = await call(
            engine, "/update_weights_from_tensor", body, self.cfg.update_weight_request_timeout
        )
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SyncFailed(f"engine {engine.name} /update_weights_from_tensor: {answer.get('message')}")

    async def sync(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> LedgerEntry:
        """Publish `tensors`, all held by this process, as `version`."""
        source = local_handle_buckets(
            tensors, self.cfg.update_weight_buffer_size, self.engine_ranks, self.encode
        )
        return await self.sync_buckets(version, source)

    async def sync_buckets(self, version: int, source: AsyncIterator[HandleBucket]) -> LedgerEntry:
        """Publish the buckets `source` yields (each engine's routed handles) as `version`.

        `source` is drained to its end whatever fails, so the trainer ranks feeding it finish
        their part of the collective instead of waiting at its next step."""
        cfg = self.cfg
        started_at = time.time()
        t0 = time.perf_counter()
        limit = cfg.update_weight_request_timeout
        moved = 0
        try:
            async with paused(self.engines, cfg.update_weight_pause_mode, limit) as pause_clock:
                # SGLang 0.5.23 takes tensor updates only inside a weight-update session.
                await on_all(self.engines, lambda e: call(e, "/begin_weight_update", {}, limit))
                async for bucket in source:
                    if len(bucket.payloads) != len(self.engines):
                        raise SyncFailed(
                            f"{len(bucket.payloads)} engines' handles for {len(self.engines)} engines"
                        )
                    tagged = version if bucket.last else None
                    async with asyncio.TaskGroup() as tg:
                        for engine, payloads in zip(self.engines, bucket.payloads, strict=True):
                            tg.create_task(self._post(engine, payloads, tagged))
                    moved += bucket.nbytes
                await on_all(self.engines, lambda e: call(e, "/end_weight_update", {}, limit))
                pause_s = pause_clock()
        finally:
            async for _ in source:
                pass
        return await confirmed_entry(
            self.engines,
            limit,
            version=version,
            transport=self.name,
            bytes_moved=moved * len(self.engines),
            pause_seconds=pause_s,
            perf_started=t0,
            started_at=started_at,
        )

"""Colocated sync (--colocate): tensors pass as shared-memory handles through /update_weights_from_tensor.

Trainer and engines share the devices. Order per sync: the trainer offloads (its own job, done
before calling sync), the engines resume their memory, buckets of named tensors are encoded as
handles (CUDA IPC on GPU, shared memory on CPU) by the engine side's encoder and posted, one
entry per engine TP rank. `release` gives the engines' memory back before training resumes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from tether.sync.buckets import buckets, nbytes, with_last
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import EngineEndpoint, SyncFailed, call, confirmed_entry, on_all, paused
from tether.sync.ledger import LedgerEntry

Named = list[tuple[str, torch.Tensor]]


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

    async def resume(self) -> None:
        limit = self.cfg.update_weight_request_timeout
        await on_all(self.engines, lambda e: call(e, "/resume_memory_occupation", {}, limit))

    async def release(self) -> None:
        """Engines free their memory so the trainer can load back (call before training)."""
        limit = self.cfg.update_weight_request_timeout
        await on_all(self.engines, lambda e: call(e, "/release_memory_occupation", {}, limit))

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

    async def sync(
        self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], *, resume_engines: bool = True
    ) -> LedgerEntry:
        cfg = self.cfg
        started_at = time.time()
        t0 = time.perf_counter()
        limit = cfg.update_weight_request_timeout
        if resume_engines:
            await self.resume()
        moved = 0
        async with paused(self.engines, cfg.update_weight_pause_mode, limit) as pause_clock:
            # SGLang 0.5.23 takes tensor updates only inside a weight-update session.
            await on_all(self.engines, lambda e: call(e, "/begin_weight_update", {}, limit))
            for bucket, last in with_last(buckets(tensors, cfg.update_weight_buffer_size)):
                # The shared copies must outlive the engines' reads of them.
                shared = await asyncio.to_thread(self.encode.share, bucket)
                tagged = version if last else None
                async with asyncio.TaskGroup() as tg:
                    for engine, ranks in zip(self.engines, self.engine_ranks, strict=True):
                        # One entry per engine TP rank, each serialised on its own (CUDA IPC).
                        payloads = [self.encode.serialize(shared) for _ in range(ranks)]
                        tg.create_task(self._post(engine, payloads, tagged))
                moved += sum(nbytes(t) for _, t in bucket)
                del shared
            await on_all(self.engines, lambda e: call(e, "/end_weight_update", {}, limit))
            pause_s = pause_clock()
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

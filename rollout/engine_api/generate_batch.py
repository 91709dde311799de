"""Generate requests that belong together travel to their engine as one batched /generate call.

A rollout sends every sample of a group at once, and the group is scored only when its last
sample is back, so sending the group's prompts in one request (SGLang's batch form: `input_ids`
a list of prompts, `sampling_params` and `rid` one per prompt; the answer a list in the same
order) changes nothing a caller sees but saves the engine and the client one HTTP exchange per
sample (measured on the demo's 128-sample step: ~60 ms of CPU on 2 cores, see `tether bench e2e`).

The requests made under one key in the same event-loop iteration form a batch; a request alone
in its batch is sent as a single request. Each request keeps its own rid (an abort by rid still
reaches just that prompt). A failed batch fails each of its requests with the same error. When
every caller waiting on a batch is cancelled, the batch's HTTP request is cancelled too (the
engine then aborts its prompts, as for a single request whose client went away).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
A = TypeVar("A")


@dataclass(eq=False)
class Pending:
    """One caller's prompt in a batch, and the future its answer arrives on."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GenerateBatcher(Generic[K, A]):
    """Collects same-key requests of one loop iteration and sends each collection once with
    `send(key, requests)`, which returns one answer per request, in order."""

    def __init__(self, send: Callable[[K, list[Pending]], Awaitable[list[A]]]) -> None:
        self._send = send
        self._open: dict[K, list[Pending]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def submit(self, key: K, request: Pending) -> A:
        """Queue `request` under `key` and return its answer once its batch has been answered."""
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = []
            # Runs after every callback already queued: the other requests of this iteration.
            asyncio.get_running_loop().call_soon(self._flush, key)
        batch.append(request)
        answer: A = await request.future
        return answer

    def _flush(self, key: K) -> None:
        batch = [r for r in self._open.pop(key, []) if not r.future.done()]
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._answer(key, batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        abandoned = functools.partial(_cancel_when_abandoned, batch, task)
        for request in batch:
            request.future.add_done_callback(abandoned)

    async def _answer(self, key: K, batch: list[Pending]) -> None:
        try:
            answers = await self._send(key, batch)
        except asyncio.CancelledError:
            for request in batch:
                if not request.future.done():
                    request.future.cancel()
            raise
        except Exception as exc:  # the batch's error belongs to each of its callers
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        for request, answer in zip(batch, answers, strict=True):
            if not request.future.done():
                request.future.set_result(answer)

    async def close(self) -> None:
        """Cancel the batches still being sent and wait for them (their callers are cancelled)."""
        tasks = list(self._sending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _cancel_when_abandoned(batch: list[Pending], task: asyncio.Task[None], _: asyncio.Future[Any]) -> None:
    """Cancel the batch's request once every one of its callers has gone (cancelled)."""
    if not task.done() and all(r.future.cancelled() for r in batch):
        task.cancel()

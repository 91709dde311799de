"""The sglang-router's worker list, changed while the router runs (--use-sglang-router).

An engine that dies, is lost with its node, rejoins, joins or drains must leave or enter the
router's list too: tether's own Router holds only the sglang-router in that mode, so requests
would otherwise go on reaching a dead engine and never reach a new one.

sglang-router 0.3.2 (the smg gateway) serves its control plane beside its data plane, behind
the same key: `GET /workers` (each worker's `id`, `url`, `is_healthy`), `POST /workers`
(`url`, `api_key`, `worker_type`, `bootstrap_port`) and `DELETE /workers/{id}`. Both changes are
queued jobs answered 202 before they take effect, so each call here polls the list until the
change shows, within a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from tether.rollout.engine_api.client import EngineClient


class WorkerListError(RuntimeError):
    """The sglang-router did not apply a change to its worker list in time, or answered oddly."""


class RouterWorker(msgspec.Struct, kw_only=True):
    """One entry of the router's `GET /workers` (fields tether reads; the rest are ignored)."""

    id: str
    url: str
    is_healthy: bool = True
    worker_type: str = "regular"


class _WorkerList(msgspec.Struct):
    workers: list[RouterWorker]


class RouterWorkers:
    """The worker list of the sglang-router at `url`; `api_key` is the run's engine key, which
    the router requires of its clients and passes on to the workers it adds."""

    def __init__(
        self, url: str, *, api_key: str | None, timeout: float = 60.0, poll_interval: float = 0.1
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._api_key = api_key
        self._client = EngineClient(url, name="sglang-router", api_key=api_key, request_timeout=timeout)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> RouterWorkers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def workers(self) -> dict[str, RouterWorker]:
        """The router's workers now, by URL."""
        answer = await self._client.request("GET", "/workers")
        try:
            listed = msgspec.convert(answer, _WorkerList)
        except msgspec.ValidationError as exc:
            raise WorkerListError(f"{self.url}/workers answered {str(answer)[:300]!r}: {exc}") from exc
        return {worker.url: worker for worker in listed.workers}

    async def add(self, url: str, *, worker_type: str = "regular", bootstrap_port: int | None = None) -> None:
        """Add the engine at `url` (healthy, caught up: it takes requests at once); return once the
        router lists it healthy. A stale entry for the same URL (a process replaced at that
        address) is removed first, so the router's health and load state start afresh."""
        if url in await self.workers():
            await self.remove(url)
        body: dict[str, Any] = {"url": url, "api_key": self._api_key, "worker_type": worker_type}
        if worker_type == "prefill":
            body["bootstrap_port"] = bootstrap_port
        await self._client.request("POST", "/workers", body, retry="connect")
        await self._until(lambda found: url in found and found[url].is_healthy, f"add {url}")

    async def remove(self, url: str) -> bool:
        """Remove the engine at `url` if the router lists it; return once it is gone, with
        whether it was listed."""
        worker = (await self.workers()).get(url)
        if worker is None:
            return False  # never added, or removed already
        await self._client.request("DELETE", f"/workers/{worker.id}", retry="connect")
        await self._until(lambda found: url not in found, f"remove {url}")
        return True

    async def _until(self, done: Callable[[dict[str, RouterWorker]], bool], what: str) -> None:
        """Poll the list until `done(workers)` holds, within `timeout`."""
        try:
            async with asyncio.timeout(self.timeout):
                # The router applies its jobs in the background and tells no one: ask again.
                while True:
                    if done(await self.workers()):
                        return
                    await asyncio.sleep(self.poll_interval)
        except TimeoutError:
            listed = sorted(await self.workers())
            raise WorkerListError(
                f"sglang-router at {self.url} did not {what} within {self.timeout:.0f}s; it lists {listed}"
            ) from None

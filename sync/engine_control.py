"""What a weight transport needs from an engine, and the control calls every transport shares.

`EngineEndpoint` is satisfied by tether.rollout.engine_api.client.EngineClient (and by any HTTP
client with the same `request`); sync depends only on this Protocol. Every call carries a timeout,
and calls to several engines run concurrently in one TaskGroup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol, TypeVar

from tether.sync.ledger import LedgerEntry

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineEndpoint(Protocol):
    """One engine speaking SGLang's HTTP API."""

    name: str
    url: str

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        retry: Literal["never", "connect", "always"] = "always",
        request_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any: ...


class SyncFailed(RuntimeError):
    """A weight sync did not complete; the message names the engine and the step."""


async def call(engine: EngineEndpoint, path: str, body: Mapping[str, Any] | None, limit_s: float) -> Any:
    """POST one control call, bounded by `limit_s`, never retried (the transport decides)."""
    try:
        async with asyncio.timeout(limit_s):
            answer = await engine.request("POST", path, body, retry="never", request_timeout=limit_s)
    except TimeoutError as exc:
        raise SyncFailed(f"engine {engine.name} {path}: no answer within {limit_s}s") from exc
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SyncFailed(f"engine {engine.name} {path}: {answer.get('message')}")
    return answer


async def on_all(
    engines: Sequence[EngineEndpoint], fn: Callable[[EngineEndpoint], Coroutine[Any, Any, T]]
) -> list[T]:
    """Run fn on every engine concurrently; the first failure cancels the rest and is raised."""
    async with asyncio.TaskGroup() as tg:
        tasks: list[asyncio.Task[T]] = [tg.create_task(fn(e)) for e in engines]
    return [t.result() for t in tasks]


async def best_effort_on_all(
    engines: Sequence[EngineEndpoint], fn: Callable[[EngineEndpoint], Awaitable[Any]]
) -> dict[str, BaseException]:
    """Run fn on every engine; collect failures instead of raising (for cleanup paths)."""
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    return {e.name: r for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)}


def parse_version(value: Any) -> int | None:
    if isinstance(value, dict):
        value = value.get("weight_version")
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


async def served_version(engine: EngineEndpoint, limit_s: float) -> int | None:
    """The weight version an engine reports (None when it reports none or a non-numeric one)."""
    async with asyncio.timeout(limit_s):
        # SGLang 0.5.23 reports the version only in /get_model_info (/get_weight_version is a 404).
        answer = await engine.request("GET", "/get_model_info", None, retry="always", request_timeout=limit_s)
    return parse_version(answer.get("weight_version") if isinstance(answer, dict) else answer)


async def served_versions(engines: Sequence[EngineEndpoint], limit_s: float) -> dict[str, int | None]:
    versions = await on_all(engines, lambda e: served_version(e, limit_s))
    return {e.name: v for e, v in zip(engines, versions, strict=True)}


async def confirmed_entry(
    engines: Sequence[EngineEndpoint],
    limit_s: float,
    *,
    version: int,
    transport: str,
    bytes_moved: int,
    pause_seconds: float,
    perf_started: float,
    started_at: float,
    note: str = "",
) -> LedgerEntry:
    """The ledger entry of a sync whose transfer is done, with each engine's served version asked now."""
    versions = await served_versions(engines, limit_s)
    return LedgerEntry.finished(
        version=version,
        transport=transport,
        bytes_moved=bytes_moved,
        pause_seconds=pause_seconds,
        perf_started=perf_started,
        started_at=started_at,
        engine_versions=versions,
        note=note,
    )


async def pause_all(engines: Sequence[EngineEndpoint], mode: str, limit_s: float, flush: bool = True) -> None:
    """Pause generation on every engine (the first failure raises), then flush their caches."""
    await on_all(engines, lambda e: call(e, "/pause_generation", {"mode": mode}, limit_s))
    if flush:
        # SGLang refuses a flush while any request waits (a heartbeat, say); the cache is
        # dropped by the weight update itself then, so a refused flush is not a failed sync.
        refused = await best_effort_on_all(engines, lambda e: call(e, "/flush_cache", None, limit_s))
        for name, exc in refused.items():
            log.warning("engine %s did not flush its cache before the weight update: %s", name, exc)


async def continue_all(engines: Sequence[EngineEndpoint], limit_s: float) -> dict[str, BaseException]:
    """Continue generation on every engine, whatever happened; the failures by engine name."""
    return await best_effort_on_all(engines, lambda e: call(e, "/continue_generation", {}, limit_s))


@asynccontextmanager
async def paused(
    engines: Sequence[EngineEndpoint], mode: str, limit_s: float, flush: bool = True
) -> AsyncIterator[Callable[[], float]]:
    """Pause generation (and flush caches) on every engine; always continue every engine after.

    Engines are continued even when the body fails, so no engine is left paused (a lock that a
    failed transfer would otherwise never release).
    """
    started = asyncio.get_running_loop().time()
    try:
        await pause_all(engines, mode, limit_s, flush)
        yield lambda: asyncio.get_running_loop().time() - started
    finally:
        failures = await continue_all(engines, limit_s)
        if failures:
            raise SyncFailed(f"/continue_generation failed on {sorted(failures)}: {failures}")


async def reload_from_disk(engine: EngineEndpoint, path: str, version: int, limit_s: float) -> None:
    answer = await call(
        engine, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}, limit_s
    )
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SyncFailed(f"engine {engine.name} /update_weights_from_disk {path}: {answer.get('message')}")

"""The built-in router: picks an engine for each generate request and caps concurrency per engine.

Policies: round-robin, least-in-flight, and consistent hashing on a routing key (the session id,
slime's `X-SMG-Routing-Key`), so every turn of a multi-turn session returns to its engine; a
request without a key falls back to least-in-flight. Engines can be added and removed while
running (the restart path): a removed engine takes no new requests, and only the keys that
hashed to it move.

With --use-sglang-router the router is *fronted*: requests go to one client, the sglang-router
process (the routing key passes through as its header), while the engines behind it are held
apart, reached directly for what the sglang-router does not serve (it answers 404 to
/pause_generation and /abort_request): pause, resume, abort and every `broadcast`. Adding and
removing engines then changes only that set; the engine pool changes the sglang-router's own
worker list (sglang_router_workers.py). A gateway error from the sglang-router (502/503/504: the
worker behind it went away) counts as the engine being unavailable, as a refused connection
does without it, so fault tolerance requeues the sample's group.

The router also measures each engine's busy time (time with at least one request in flight),
which the rollout benchmark reports as the engine busy fraction.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import xxhash

from tether.rollout.config import RolloutConfig, RoutingPolicy
from tether.rollout.engine_api.client import (
    EngineClient,
    EngineError,
    EngineUnavailable,
    GenerateResponse,
    PauseMode,
    new_request_id,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
VIRTUAL_NODES = 64  # points per engine on the hash ring: keeps the key spread even with few engines
GATEWAY_ERRORS = frozenset({502, 503, 504})  # the sglang-router could not reach (or has no) worker


class NoEngineError(RuntimeError):
    """No engine is registered with the router."""


class EngineStats(msgspec.Struct, kw_only=True):
    name: str
    url: str
    in_flight: int
    requests: int
    busy_seconds: float


class _Slot:
    """Book-keeping for one engine: concurrency cap, in-flight count, busy time."""

    def __init__(self, client: EngineClient, concurrency: int, clock: Callable[[], float]) -> None:
        self.client = client
        self.semaphore = asyncio.Semaphore(concurrency)
        self.in_flight = 0
        self.waiting = 0
        self.requests = 0
        self.busy_seconds = 0.0
        self._busy_since: float | None = None
        self._clock = clock
        self.rids: set[str] = set()

    def enter(self) -> None:
        if self.in_flight == 0:
            self._busy_since = self._clock()
        self.in_flight += 1
        self.requests += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self.busy_seconds += self._clock() - self._busy_since
            self._busy_since = None

    def busy_now(self) -> float:
        extra = self._clock() - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_seconds + extra


class Router:
    """Routes generate requests over a changing set of engines."""

    def __init__(
        self,
        engines: Iterable[EngineClient] = (),
        *,
        policy: RoutingPolicy = "least_in_flight",
        concurrency_per_engine: int = 512,
        clock: Callable[[], float] = time.monotonic,
        engineless: str | None = None,
        batch_requests: bool = True,
        front: EngineClient | None = None,
    ) -> None:
        """`front`: the sglang-router every request goes to; `engines` are then the engines behind
        it, reached directly only for control (see the module docstring)."""
        self.policy: RoutingPolicy = policy
        self.batch_requests = batch_requests
        """Requests under one batch key go to their engine together (see `generate`); off in front
        of the sglang-router, whose per-request balancing tether does not second-guess."""
        self.engineless = engineless
        """Why no engine will ever be routed (a run without engines): asking for one fails at once
        with this reason instead of waiting for an engine that never comes."""
        self._concurrency = concurrency_per_engine
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._ring: list[tuple[int, str]] = []
        self._rr = itertools.count()
        self._has_engine = asyncio.Event()
        self.front = front
        self._behind: dict[str, EngineClient] = {}
        if front is not None:
            self._slots[front.name] = _Slot(front, concurrency_per_engine, clock)
        for engine in engines:
            self.add_engine(engine)

    @classmethod
    def from_config(
        cls,
        config: RolloutConfig,
        engine_urls: Sequence[str],
        *,
        router_url: str | None = None,
        api_key: str | None = None,
    ) -> Router:
        """Clients for `engine_urls` (or one for the sglang-router at `router_url`) behind a Router;
        each sends `api_key`, the run's engine key (the sglang-router takes the same one)."""
        timeout = config.engine_request_timeout_seconds
        if config.use_sglang_router:
            if router_url is None:
                raise ValueError("--use-sglang-router needs the router's URL")
            total = config.sglang_server_concurrency * max(1, len(engine_urls))
            front = EngineClient(
                router_url,
                name="sglang-router",
                max_connections=total,
                request_timeout=timeout,
                api_key=api_key,
            )
            behind = [
                EngineClient(url, name=f"engine{i}", request_timeout=timeout, api_key=api_key)
                for i, url in enumerate(engine_urls)
            ]
            return cls(
                behind,
                front=front,
                policy="round_robin",
                concurrency_per_engine=total,
                batch_requests=False,
            )
        clients = [
            EngineClient(
                url,
                name=f"engine{i}",
                max_connections=config.sglang_server_concurrency,
                request_timeout=timeout,
                api_key=api_key,
            )
            for i, url in enumerate(engine_urls)
        ]
        return cls(
            clients,
            policy=config.rollout_routing_policy,
            concurrency_per_engine=config.sglang_server_concurrency,
        )

    # ----- membership -----
    @property
    def engines(self) -> list[EngineClient]:
        """The engines: those requests go to, or when fronted those behind the sglang-router."""
        if self.front is not None:
            return list(self._behind.values())
        return [slot.client for slot in self._slots.values()]

    def add_engine(self, client: EngineClient) -> None:
        known = self._behind if self.front is not None else self._slots
        if client.name in known:
            raise ValueError(f"an engine named {client.name!r} is already routed")
        if self.front is not None:
            self._behind[client.name] = client
        else:
            self._slots[client.name] = _Slot(client, self._concurrency, self._clock)
        self._rebuild_ring()

    def remove_engine(self, name: str) -> EngineClient:
        """Stop routing to `name`; its in-flight requests finish. Returns its client (caller closes it)."""
        if self.front is not None:
            client = self._behind.pop(name)
        else:
            client = self._slots.pop(name).client
        self._rebuild_ring()
        return client

    def _rebuild_ring(self) -> None:
        ring = [
            (xxhash.xxh64_intdigest(f"{name}#{v}".encode()), name)
            for name in self._slots
            for v in range(VIRTUAL_NODES)
        ]
        ring.sort()
        self._ring = ring
        if self.engines:
            self._has_engine.set()
        else:
            self._has_engine.clear()

    async def wait_for_engine(self) -> None:
        """Return once at least one engine is routed (all of them may be restarting)."""
        if self.engineless is not None:
            raise NoEngineError(self.engineless)
        await self._has_engine.wait()

    # ----- choosing -----
    def pick(self, routing_key: str | None = None) -> EngineClient:
        return self._pick_slot(routing_key).client

    def _pick_slot(self, routing_key: str | None) -> _Slot:
        if not self.engines:  # fronted: the sglang-router's worker list is empty too
            raise NoEngineError(self.engineless or "no engine is registered with the router")
        if self.policy == "consistent_hash" and routing_key:
            h = xxhash.xxh64_intdigest(routing_key.encode())
            pos = bisect.bisect_left(self._ring, (h, ""))
            return self._slots[self._ring[pos % len(self._ring)][1]]
        slots = list(self._slots.values())
        if self.policy == "round_robin":
            return slots[next(self._rr) % len(slots)]
        # least in flight, counting requests queued for a slot; ties go round-robin
        start = next(self._rr) % len(slots)
        rotated = slots[start:] + slots[:start]
        return min(rotated, key=lambda s: s.in_flight + s.waiting)

    @asynccontextmanager
    async def _occupy(self, slot: _Slot, rid: str) -> AsyncIterator[None]:
        slot.waiting += 1
        try:
            await slot.semaphore.acquire()
        finally:
            slot.waiting -= 1
        slot.enter()
        slot.rids.add(rid)
        try:
            yield
        finally:
            slot.rids.discard(rid)
            slot.leave()
            slot.semaphore.release()

    # ----- requests -----
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        routing_key: str | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
        return_routed_experts: bool = False,
        batch_key: Hashable | None = None,
    ) -> tuple[str, GenerateResponse]:
        """Generate on the chosen engine; returns (engine name, response). `return_routed_experts`:
        the MoE experts each token was routed to come back too (--use-rollout-routing-replay).
        `batch_key`: requests under one key made together reach their engine in one batched call
        (EngineClient.generate); each still counts as one request here."""
        slot = self._pick_slot(routing_key)
        rid = rid or new_request_id()
        async with self._occupy(slot, rid), self._gateway_errors():
            response = await slot.client.generate(
                input_ids,
                sampling_params,
                rid=rid,
                return_logprob=return_logprob,
                routing_key=routing_key,
                return_routed_experts=return_routed_experts,
                batch_key=batch_key if self.batch_requests else None,
            )
        return slot.client.name, response

    async def call(self, routing_key: str | None, fn: Callable[[EngineClient], Coroutine[Any, Any, T]]) -> T:
        """Run `fn(client)` on a chosen engine under its concurrency cap (for custom payloads)."""
        slot = self._pick_slot(routing_key)
        async with self._occupy(slot, new_request_id()), self._gateway_errors():
            return await fn(slot.client)

    @asynccontextmanager
    async def _gateway_errors(self) -> AsyncIterator[None]:
        """Fronted: a 502/503/504 of the sglang-router is its worker gone (killed, or removed while
        the request waited), the fault a refused connection is without it."""
        try:
            yield
        except EngineError as exc:
            if self.front is None or exc.status not in GATEWAY_ERRORS:
                raise
            raise EngineUnavailable(exc.engine, exc.path, exc) from exc

    async def broadcast(self, fn: Callable[[EngineClient], Coroutine[Any, Any, T]]) -> dict[str, T]:
        """Run `fn(client)` on every engine at once (fronted: each engine behind the sglang-router,
        directly); results by engine name."""
        clients = {client.name: client for client in self.engines}
        async with asyncio.TaskGroup() as tg:
            tasks = {name: tg.create_task(fn(client)) for name, client in clients.items()}
        return {name: task.result() for name, task in tasks.items()}

    async def abort_all(self) -> None:
        """Abort every request in flight on every engine (they answer with finish_reason abort).

        An engine that cannot be reached is skipped: its requests fail on their own (and are
        requeued), and the engine pool's heartbeat restarts it. Raising here would end a run
        because an engine died during a pause, the very fault the pool exists to survive.
        """

        async def abort(client: EngineClient) -> None:
            try:
                await client.abort_all()
            except EngineUnavailable as exc:
                log.warning("abort skipped: %s", exc)

        await self.broadcast(abort)

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.broadcast(lambda c: c.pause_generation(mode))

    async def resume(self) -> None:
        await self.broadcast(lambda c: c.continue_generation())

    async def close(self) -> None:
        for client in [slot.client for slot in self._slots.values()] + list(self._behind.values()):
            await client.close()

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----- measurements -----
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self._slots.values())

    def stats(self) -> list[EngineStats]:
        return [
            EngineStats(
                name=n,
                url=s.client.url,
                in_flight=s.in_flight,
                requests=s.requests,
                busy_seconds=s.busy_now(),
            )
            for n, s in self._slots.items()
        ]

    def busy_seconds(self) -> dict[str, float]:
        return {n: s.busy_now() for n, s in self._slots.items()}

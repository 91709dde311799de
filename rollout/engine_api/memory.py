"""Which memory each engine has released (SGLang's /release_memory_occupation), kept in one place.

A colocated run hands the engines' device memory to the trainer and back every step, by SGLang's
memory tags: `weights`, `kv_cache`, `cuda_graph`. SGLang 0.5.23 is strict about the order: a
resume of a tag that is not released raises KeyError in its scheduler (it removes the tag from a
set), which kills the engine, and a release requires an idle engine (it asserts no request is in
flight, a health probe's one-token generation included). So the head sends every release and
resume through `EngineMemory`, which names only the tags that change (a resume only released
ones, a release only resident ones) and holds back the health probes of an engine while its
memory is being released or is released (a released engine cannot generate).

    memory = EngineMemory()
    await memory.release(clients)                  # every tag, before the trainer takes the device
    await memory.resume(clients, WEIGHTS)          # before a weight update
    await memory.resume(clients, GENERATION)       # before generating
    await memory.probe(client.url, client.health_generate)   # skipped while released
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol

MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
WEIGHTS: tuple[MemoryTag, ...] = ("weights",)
GENERATION: tuple[MemoryTag, ...] = ("kv_cache", "cuda_graph")
"""What generating needs besides the weights (slime resumes these two together)."""
ALL_TAGS: tuple[MemoryTag, ...] = WEIGHTS + GENERATION
"""SGLang's GPU_MEMORY_ALL_TYPES, what a release with no tags means."""


class MemoryControl(Protocol):
    """An engine's memory endpoints (tether.rollout.engine_api.client.EngineClient)."""

    url: str
    name: str

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any: ...

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any: ...


class EngineMemory:
    """The released memory tags of every engine, by URL (a restarted engine keeps its URL)."""

    def __init__(self) -> None:
        self._released: dict[str, set[str]] = {}
        self._quiet: set[str] = set()  # releasing or released: no health probe may start
        self._probing: dict[str, int] = {}
        self._probes_done = asyncio.Condition()

    def released(self, url: str) -> frozenset[str]:
        """The tags `url` has released now."""
        return frozenset(self._released.get(url, ()))

    def resident(self, url: str, tags: Sequence[str] = ALL_TAGS) -> bool:
        """Whether `url` holds all of `tags`."""
        return not self.released(url) & set(tags)

    async def release(self, engines: Sequence[MemoryControl], tags: Sequence[MemoryTag] = ALL_TAGS) -> None:
        """Release `tags` on every engine that still holds them, at once; the engines' health
        probes stop first and one in flight is waited for (SGLang releases only an idle engine)."""
        async with asyncio.TaskGroup() as tg:
            for engine in engines:
                tg.create_task(self._release(engine, tags))

    async def resume(self, engines: Sequence[MemoryControl], tags: Sequence[MemoryTag]) -> None:
        """Resume those of `tags` each engine has released, at once; an engine with nothing of
        them released gets no call. Its health probes start again once nothing is released."""
        async with asyncio.TaskGroup() as tg:
            for engine in engines:
                tg.create_task(self._resume(engine, tags))

    def restarted(self, url: str) -> None:
        """A new process serves `url`: it starts holding all of its memory."""
        self._released.pop(url, None)
        self._quiet.discard(url)

    async def probe(self, url: str, check: Callable[[], Awaitable[None]]) -> None:
        """Run `check` (a health probe) unless the engine's memory is released or being
        released; then it passes without touching the engine (its process exit is still watched)."""
        if url in self._quiet:
            return
        self._probing[url] = self._probing.get(url, 0) + 1
        try:
            await check()
        finally:
            self._probing[url] -= 1
            async with self._probes_done:
                self._probes_done.notify_all()

    async def _release(self, engine: MemoryControl, tags: Sequence[MemoryTag]) -> None:
        released = self._released.setdefault(engine.url, set())
        todo = [t for t in tags if t not in released]
        if not todo:
            return
        self._quiet.add(engine.url)
        try:
            async with self._probes_done:
                await self._probes_done.wait_for(lambda: not self._probing.get(engine.url))
            await engine.release_memory_occupation(todo)
            released.update(todo)
        finally:
            if not released:  # the release failed before anything was given up
                self._quiet.discard(engine.url)

    async def _resume(self, engine: MemoryControl, tags: Sequence[MemoryTag]) -> None:
        released = self._released.get(engine.url, set())
        todo = [t for t in tags if t in released]
        if not todo:
            return
        await engine.resume_memory_occupation(todo)
        released.difference_update(todo)
        if not released:
            self._quiet.discard(engine.url)

"""Full distributed sync: names/dtypes/shapes over HTTP, tensors by broadcast over the update group.

The source rank (rank 0 of the update group; a trainer's TP-0/DP-0 rank of a pipeline stage) and
every engine rank (rank_offset + its TP rank) form a standalone gloo/nccl group through
tether.runtime.weight_group, the kind SGLang's /init_weights_update_group builds. Per sync:
pause (mode by flag) -> flush -> /begin_weight_update -> for each bucket of at most
--update-weight-buffer-size bytes: /update_weights_from_distributed on every engine while this
process broadcasts the bucket's tensors in order -> /end_weight_update -> continue. Only the last
bucket carries the new weight_version, so a failed sync leaves engines reporting the old one.
Engines that offer it (tether's CPU engine; see tether.runtime.bucket_stream) take the buckets
of a sync as one stream instead: one request each, every bucket's names, dtypes and shapes sent
over the group ahead of its bytes, so no HTTP round trip sits between two buckets.
Blocking collectives run in a worker thread; every HTTP call and the group set-up have timeouts.

A GPU sender names its GPU (`device`): the export, the buckets' buffers and copies, the group
and its broadcasts all run with that GPU current in whichever thread does the work, never with
the thread's own current device (a rank chose its GPU on its worker thread only). Its flattened
buckets' two buffers are freed when a sync ends, so training has that memory between syncs; a
CPU sender keeps them (fresh host pages cost more than the copy into them).

An engine that refuses or fails a bucket while this process is inside its broadcast never
joins it. Over NCCL that broadcast would hold this GPU's streams until the group's timeout,
then NCCL's watchdog would end the process: the group is aborted at once instead, the sync
raises SyncFailed naming the engine and its answer, and the next sync builds a new group (as
after any failed sync, whatever the backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tether.runtime.bucket_stream import STREAM_CAPABILITY, STREAM_ENDPOINT
from tether.runtime.errors import ConfigError
from tether.runtime.weight_group import (
    WeightGroup,
    abort_weight_group,
    broadcast,
    check_device,
    destroy_weight_group,
    gpu_current,
    host_store,
    init_weight_group,
)
from tether.sync.buckets.fill import Bucket, BucketFiller
from tether.sync.buckets.grouping import dtype_name
from tether.sync.buckets.pump import BucketPump
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import (
    EngineEndpoint,
    SyncFailed,
    best_effort_on_all,
    call,
    confirmed_entry,
    continue_all,
    on_all,
    pause_all,
    paused,
    reload_from_disk,
)
from tether.sync.ledger import LedgerEntry

log = logging.getLogger(__name__)
T = TypeVar("T")


def broadcast_async(tensor: torch.Tensor, src: int, group: WeightGroup) -> dist.Work:
    """Start a broadcast on the weight group; wait() on the result before reusing the tensor."""
    work = dist.broadcast(tensor, src=src, group=group.group, async_op=True)
    assert work is not None
    return work


ABORT_WAIT_S = 30.0
"""How long a failed sync waits for an NCCL abort to return (it has been seen to hang)."""


def wire_device(backend: str, device: torch.device | None = None) -> torch.device:
    """Where a broadcast's tensors must live: the sender's own GPU (`device`, which NCCL
    requires: a thread's current GPU is not the rank's) for NCCL, host memory for gloo (a tensor
    elsewhere is moved there once, as the buckets are formed)."""
    if backend == "nccl":
        if device is None:
            raise ConfigError("device", None, "an NCCL sender must name its GPU (cuda:N)")
        check_device(backend, device)
        return device
    check_device(backend, device)
    return torch.device("cpu")


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], into: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of every tensor of a bucket, in order, as one contiguous uint8 tensor (written
    into the front of `into` when it is large enough and on the same device)."""
    parts = [t.reshape(-1).view(torch.uint8) for _, t in bucket]
    total = sum(p.numel() for p in parts)
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    if into is None or into.numel() < total or into.device != parts[0].device:
        return torch.cat(parts)
    return torch.cat(parts, out=into[:total])


async def _sent_unless_refused(
    sending: asyncio.Future[T], posts: Sequence[asyncio.Task[list[object]]], limit_s: float | None
) -> T:
    """Wait for `sending` (a bucket's broadcast, or the next bucket's export, which on a GPU
    may queue behind it); raise at once when any engine's answer so far is a failure (an engine
    that refused before receiving would otherwise leave it blocked). Never cancels `sending`."""
    async with asyncio.timeout(limit_s):
        while True:
            for p in posts:
                if p.done() and p.exception() is not None:
                    raise p.exception()  # type: ignore[misc]
            if sending.done():
                return sending.result()
            waiting: list[asyncio.Future[Any]] = [sending, *(p for p in posts if not p.done())]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)


async def _let_engines_answer(posts: Sequence[asyncio.Task[list[object]]], limit_s: float) -> None:
    """After a failure: the engines finish (or refuse) what they were sent, within `limit_s`,
    before the session closes."""
    unanswered = [p for p in posts if not p.done()]
    if unanswered:
        await asyncio.wait(unanswered, timeout=limit_s)


def _engine_failed(posts: Sequence[asyncio.Task[list[object]]]) -> bool:
    return any(p.done() and not p.cancelled() and p.exception() is not None for p in posts)


def _first_leaf(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups: one engine's failure under on_all."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _named_call(engine: EngineEndpoint, path: str, body: dict[str, object], limit_s: float) -> object:
    """`call`, with any failure a SyncFailed that names the engine."""
    try:
        return await call(engine, path, body, limit_s)
    except SyncFailed:
        raise
    except Exception as exc:
        # The engine API's own errors name the engine already (their .engine).
        named = getattr(exc, "engine", None) == engine.name
        raise SyncFailed(str(exc) if named else f"engine {engine.name} {path}: {exc}") from exc


async def _close_posts(posts: Sequence[asyncio.Task[list[object]]]) -> None:
    """Cancel the requests still open (after a cancellation or the wait above) and read every
    outcome, so that none is reported as lost."""
    for p in posts:
        p.cancel()
    await asyncio.gather(*posts, return_exceptions=True)


class DistributedTransport:
    """The source side of --update-weight-transport nccl (gloo on CPU), not colocated."""

    name = "distributed"

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        cfg: WeightSyncConfig,
        *,
        master_address: str = "127.0.0.1",
        master_port: int,
        engine_ranks: Sequence[int] | None = None,
        backend: str = "gloo",
        control_engines: bool = True,
        group_tag: str = "",
        stream_buckets: bool = True,
        device: torch.device | None = None,
    ) -> None:
        """engine_ranks: ranks each engine contributes (its TP size; default 1 each).

        device: the sender rank's own GPU (cuda:N), required for NCCL; None for gloo.

        stream_buckets: send a sync's buckets as one stream (tether.runtime.bucket_stream) when
        every engine offers it; False keeps SGLang's request per bucket (tests of that path).

        control_engines: whether this source pauses/continues the engines (exactly one source
        does when several pipeline stages each broadcast their own tensors, see sync_stage).
        master_port 0: the group's store listens on a free port of master_address.
        """
        self.engines = list(engines)
        self.cfg = cfg
        self.master_address = master_address
        self.master_port = master_port
        self.engine_ranks = list(engine_ranks or [1] * len(self.engines))
        if len(self.engine_ranks) != len(self.engines) or min(self.engine_ranks, default=1) < 1:
            raise SyncFailed(f"engine_ranks={self.engine_ranks} must give a positive rank count per engine")
        self.backend = backend
        self.device = wire_device(backend, device)
        self.control_engines = control_engines
        self.group_tag = group_tag
        self.stream_buckets = stream_buckets
        self.streamed = False
        """Whether the current group's engines all take the streamed update (set by connect)."""
        self.group: WeightGroup | None = None
        self._flat: list[torch.Tensor | None] = [None, None]
        """The flattened buckets' two buffers: kept between syncs on the CPU only."""
        self._stale = True
        self.restore_from: tuple[str, int] | None = None
        """A full checkpoint (path, version) holding the weights engines serve now: a failed sync
        reloads it so engines never keep a mix of old and new tensors. The head sets it (e.g. to
        --hf-checkpoint at version 0); without it a failed sync leaves the old version number but
        possibly some new tensors, and the next sync (always complete) overwrites them all."""

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_ranks)

    def mark_engine_restarted(self, engine_name: str | None = None) -> None:
        """An engine restarted (it left the group): rebuild the group before the next sync."""
        self._stale = True

    async def connect(self) -> None:
        """(Re)build the update group: this process as rank 0, engines at their rank offsets."""
        await self.close()
        # A server accepts a group name only once; the tag tells a pipeline stage's group apart.
        group_name = f"tether-weights-{self.group_tag}{uuid.uuid4().hex[:12]}"
        cfg = self.cfg
        limit = cfg.update_weight_collective_timeout
        store = None
        port = self.master_port
        if port == 0:  # listen on a free port first, then tell the engines which
            store = await asyncio.to_thread(
                host_store, self.master_address, 0, self.world_size, timedelta(seconds=limit)
            )
            port = store.port
        init_method = f"tcp://{self.master_address}:{port}"
        offsets = [1 + sum(self.engine_ranks[:i]) for i in range(len(self.engines))]

        offers: list[bool] = [False] * len(self.engines)

        async def engine_join(i: int) -> None:
            body = {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": offsets[i],
                "world_size": self.world_size,
                "group_name": group_name,
                "backend": self.backend,
            }
            answer = await call(self.engines[i], "/init_weights_update_group", body, limit)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise SyncFailed(
                    f"engine {self.engines[i].name} /init_weights_update_group: {answer.get('message')}"
                )
            offers[i] = isinstance(answer, dict) and answer.get(STREAM_CAPABILITY) is True

        async with asyncio.timeout(limit), asyncio.TaskGroup() as tg:
            own = tg.create_task(
                asyncio.to_thread(
                    init_weight_group,
                    init_method,
                    0,
                    self.world_size,
                    group_name,
                    self.backend,
                    timedelta(seconds=limit),
                    store,
                    None,
                    self._gpu,
                )
            )
            for i in range(len(self.engines)):
                tg.create_task(engine_join(i))
        self.group = own.result()
        self.streamed = self.stream_buckets and all(offers)
        self._stale = False

    @property
    def _gpu(self) -> torch.device | None:
        """The sender's GPU (None on a CPU sender)."""
        return self.device if self.device.type == "cuda" else None

    async def close(self) -> None:
        self._flat = [None, None]
        group, self.group = self.group, None
        if group is None:
            return
        timeout = self.cfg.update_weight_request_timeout
        await best_effort_on_all(
            self.engines,
            lambda e: call(e, "/destroy_weights_update_group", {"group_name": group.group_name}, timeout),
        )
        await asyncio.to_thread(destroy_weight_group, group)

    def _broadcast_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], flat: torch.Tensor | None = None
    ) -> None:
        """Broadcast one bucket: as its packed bytes when `flat` is given (SGLang's
        flattened_bucket: one uint8 buffer, the tensors' bytes in order), else tensor by tensor."""
        assert self.group is not None
        with gpu_current(self._gpu):
            if flat is not None:
                broadcast(flat, 0, self.group)
                return
            # Issue every tensor's broadcast at once (as slime does) so the backend can stream
            # the next tensor while the receiver is still copying out the previous one.
            works = [broadcast_async(t, 0, self.group) for _, t in bucket]
            for work in works:
                work.wait()

    async def _abort_group(self) -> None:
        """Abort the group now (see the module's docstring): every pending broadcast ends, and
        the next sync builds a new one. The engines drop their side when it is rebuilt."""
        group = self.group
        self._stale = True
        if group is None or not group.alive:
            return
        aborting = asyncio.ensure_future(asyncio.to_thread(abort_weight_group, group))
        aborting.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, _ = await asyncio.wait({aborting}, timeout=ABORT_WAIT_S)
        if not done:
            log.error("aborting weight group %s did not return within %ss", group.group_name, ABORT_WAIT_S)
        elif aborting.exception() is not None:
            log.error("aborting weight group %s failed: %s", group.group_name, aborting.exception())

    def _release_buffers(self) -> None:
        """A GPU sender's flat buffers go back to the allocator when a sync ends (a broadcast
        still reading one keeps its memory until it completes: torch holds the tensor). In
        place: the sync's filler shares the list."""
        if self.device.type == "cuda":
            self._flat[0] = self._flat[1] = None

    async def _send(self, version: int | None, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Every bucket to every engine; the last one carries `version` (None: none does).

        An engine's failure (or a broadcast that outlives the request timeout) aborts an NCCL
        group first, so no broadcast that engine will never join holds this GPU, and raises
        SyncFailed naming the engine; the sender's own export failing, or a cancelled sync,
        leaves the group to the usual rebuild (the engines still receive what was sent, and a
        stream's ABORT). A GPU sender's buffers are freed at the end, whatever the outcome."""
        try:
            return await self._send_buckets(version, tensors)
        except SyncFailed:
            raise
        except BaseExceptionGroup as exc:
            # One engine's failure under on_all; its message names the engine.
            leaf = _first_leaf(exc)
            if not isinstance(leaf, SyncFailed):
                raise
            raise SyncFailed(f"{leaf} (the next sync builds a new weight group)") from exc
        finally:
            self._release_buffers()

    async def _on_failure(self, exc: BaseException, posts: Sequence[asyncio.Task[list[object]]]) -> bool:
        """After a send failed: abort the group when a peer may be missing from a pending
        broadcast (an engine failed, or a broadcast ran out of time); whether it was aborted. A
        gloo group is left as it is: nothing pending in it can be interrupted (its thread
        returns at the group's timeout, or once the engine drops its side at the rebuild), and a
        stream's ABORT still reaches the engines over it; the next sync rebuilds it all the same."""
        if not (_engine_failed(posts) or isinstance(exc, TimeoutError)):
            return False
        if self.backend != "nccl":
            self._stale = True  # gloo: nothing to interrupt; rebuilt by the next sync
            return False
        await self._abort_group()
        return True

    async def _send_buckets(self, version: int | None, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """`_send`'s work.

        The export runs in a worker thread, one bucket ahead: bucket k+1 is exported and filled
        (tether.sync.buckets.fill) while bucket k is on the wire. Buckets are pipelined too:
        bucket k's request goes out as soon as bucket k-1's bytes have left, not when its answer
        comes back. That order is safe: a broadcast completes only after every engine posted its
        receives, i.e. is inside bucket k-1's request, so bucket k's request queues behind it
        (the engines serialise updates: SGLang under its pause condition or update lock,
        tether's engine under its update lock). Every request that went out gets its answer
        before this returns, so no engine is left inside a bucket when the caller closes the
        session; the first refusal is raised then (after an abort no engine still inside the
        aborted broadcast could answer: none is waited for). The export never runs on after this returns
        (a caller drains the rest of the stream itself).
        """
        assert self.group is not None
        group = self.group
        timeout = self.cfg.update_weight_request_timeout
        flattened = self.cfg.update_weight_flattened_bucket
        filler = BucketFiller(
            tensors,
            self.cfg.update_weight_buffer_size,
            self.device,
            flattened=flattened,
            buffers=self._flat,
            # A streamed bucket goes tensor by tensor; the engine lands a flattened one in one
            # buffer itself, so the sender packs nothing.
            pack=not self.streamed,
        )
        if self.streamed:
            return await self._send_stream(version, filler)
        moved = 0

        def fill() -> asyncio.Future[Bucket | None]:
            return asyncio.ensure_future(asyncio.to_thread(filler.next))

        posts: list[asyncio.Task[list[object]]] = []
        upcoming: asyncio.Future[Bucket | None] | None = fill()
        try:
            while upcoming is not None:
                # Never cancelled: a cancelled sync still waits for the thread in `finally`. An
                # engine's failure is seen here too: on a GPU the export of this bucket can
                # queue behind a broadcast that engine will never join.
                bucket = await _sent_unless_refused(upcoming, posts, None)
                upcoming = None
                if bucket is None:
                    break
                body: dict[str, object] = {
                    "names": [n for n, _ in bucket.tensors],
                    "dtypes": [dtype_name(t) for _, t in bucket.tensors],
                    "shapes": [list(t.shape) for _, t in bucket.tensors],
                    "group_name": group.group_name,
                    "flush_cache": bucket.last,
                }
                if bucket.last and version is not None:
                    body["weight_version"] = str(version)
                if flattened:
                    body["load_format"] = "flattened_bucket"

                async def post(e: EngineEndpoint, b: dict[str, object] = body) -> object:
                    return await _named_call(e, "/update_weights_from_distributed", b, timeout)

                posts.append(asyncio.create_task(on_all(self.engines, post)))
                sending = asyncio.ensure_future(
                    asyncio.to_thread(self._broadcast_bucket, bucket.tensors, bucket.flat)
                )
                # Left behind when an engine refuses first, its thread may still fail later (the
                # group is rebuilt then): its outcome is read here, not reported as lost.
                sending.add_done_callback(lambda f: f.cancelled() or f.exception())
                if not bucket.last:
                    # Exported and filled while this bucket is on the wire: the buffer it fills
                    # was last read by bucket k-1's broadcast, which has completed.
                    upcoming = fill()
                await _sent_unless_refused(sending, posts, timeout)
                moved += bucket.nbytes
            await asyncio.gather(*posts)
        except BaseException as exc:
            # An aborted broadcast is never finished: no engine still inside it would answer.
            if not await self._on_failure(exc, posts) and isinstance(exc, Exception):
                await _let_engines_answer(posts, timeout)
            raise
        finally:
            await _close_posts(posts)
            if upcoming is not None:
                # A filling thread cannot be cancelled: it must stop advancing the export (the
                # caller drains it next) and stop writing its buffer before either is reused.
                await asyncio.gather(upcoming, return_exceptions=True)
        return moved

    async def _send_stream(self, version: int | None, filler: BucketFiller) -> int:
        """Every bucket to every engine as one stream: one request per engine, and the buckets
        (each after its header) from one worker thread that also runs the export one bucket
        ahead (tether.sync.buckets.pump). The version is set by the engines once the stream has
        ended complete. Like `_send`: every engine answers before this returns, the first
        refusal is raised then, and the export never runs on after this returns."""
        assert self.group is not None
        timeout = self.cfg.update_weight_request_timeout
        body: dict[str, object] = {
            "group_name": self.group.group_name,
            "flattened": self.cfg.update_weight_flattened_bucket,
        }
        if version is not None:
            body["weight_version"] = str(version)

        async def post(e: EngineEndpoint) -> object:
            return await _named_call(e, STREAM_ENDPOINT, body, timeout)

        posts = [asyncio.create_task(on_all(self.engines, post))]
        pump = BucketPump(filler, self.group, self.device)
        sending = asyncio.ensure_future(asyncio.to_thread(pump.run))
        # Left behind when an engine refuses first, its outcome is read here (the group is
        # rebuilt then), not reported as lost.
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await _sent_unless_refused(sending, posts, timeout)
            await asyncio.gather(*posts)
        except BaseException as exc:
            # Aborted first over NCCL: the pump's next step may queue behind a broadcast that a
            # failed engine never joins. Else the pump ends the stream (ABORT) at its next
            # bucket boundary, so the engines answer rather than wait for more. No export step
            # after this returns either way.
            aborted = await self._on_failure(exc, posts)
            await asyncio.to_thread(pump.stop)
            if not aborted:
                await _let_engines_answer(posts, timeout)
            raise
        finally:
            await _close_posts(posts)
        return sending.result()

    async def sync(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> LedgerEntry:
        cfg = self.cfg
        started_at = time.time()
        t0 = time.perf_counter()
        timeout = cfg.update_weight_request_timeout
        if self._stale or self.group is None:
            await self.connect()
        engines = self.engines if self.control_engines else []
        pause_s = 0.0
        try:
            async with paused(engines, cfg.update_weight_pause_mode, timeout) as pause_clock:
                await on_all(self.engines, lambda e: call(e, "/begin_weight_update", {}, timeout))
                try:
                    moved = await self._send(version, tensors)
                finally:
                    # Always close the engines' update session, so no engine keeps its lock.
                    failures = await best_effort_on_all(
                        self.engines, lambda e: call(e, "/end_weight_update", {}, timeout)
                    )
                if failures:
                    raise SyncFailed(f"/end_weight_update failed on {sorted(failures)}: {failures}")
                pause_s = pause_clock()
        except BaseException:
            # A broken collective leaves the group unusable: rebuild it for the next sync.
            self._stale = True
            await self._restore()
            raise
        return await confirmed_entry(
            self.engines,
            timeout,
            version=version,
            transport=self.name,
            bytes_moved=moved * len(self.engines),
            pause_seconds=pause_s,
            perf_started=t0,
            started_at=started_at,
        )

    async def _restore(self) -> None:
        """After a failed sync: every engine back on `restore_from`, when the head set one."""
        if self.restore_from is None:
            return
        path, old = self.restore_from
        timeout = self.cfg.update_weight_request_timeout
        await best_effort_on_all(self.engines, lambda e: reload_from_disk(e, path, old, timeout))

    async def sync_stage(
        self,
        version: int,
        tensors: Iterable[tuple[str, torch.Tensor]],
        agree: Callable[[bool], Awaitable[bool]],
        turn: tuple[int, int] = (0, 1),
    ) -> LedgerEntry | None:
        """One pipeline stage's part of a sync where each stage's source broadcasts its own
        tensors over its own group (this source + the engines), as slime does at PP > 1.

        `turn` (this stage, the stages): the stages send one after another, in stage order, an
        agreement between turns. An engine takes one group's buckets at a time; with stages
        sending at once, two engines could each wait inside another stage's broadcast than the
        other (a deadlock across the groups, the run's hang). A stage's source iterates its
        tensors in its turn even after a failure elsewhere (sending nothing): the iteration
        drives its stage's TP gathers, which its peers join in the same turn.

        The controlling source (control_engines) pauses the engines and opens their update
        session before any stage sends, and sets the version, closes the session and continues
        the engines after every stage has sent. `agree(ok)` must return True on every source only
        when `ok` holds on all of them (an all-reduce over the trainer's ranks), so the stages go
        through both phases together and a failure in any stage fails the sync everywhere. The
        controller returns the ledger entry; the other stages return None.
        """
        cfg = self.cfg
        started_at, t0 = time.time(), time.perf_counter()
        timeout = cfg.update_weight_request_timeout
        controller = self.control_engines
        loop = asyncio.get_running_loop()
        opened = ok = True
        paused_at = loop.time()
        try:
            if self._stale or self.group is None:
                await self.connect()
            if controller:
                paused_at = loop.time()
                await pause_all(self.engines, cfg.update_weight_pause_mode, timeout)
                await on_all(self.engines, lambda e: call(e, "/begin_weight_update", {}, timeout))
        except Exception:
            log.exception("pipeline stage %r could not open its part of sync %d", self.group_tag, version)
            opened = False
        moved = 0
        remaining = iter(tensors)
        mine, stages = turn
        if await agree(opened):
            for stage in range(stages):
                if stage == mine and ok:
                    try:
                        moved = await self._send(None, remaining)
                    except Exception:
                        log.exception(
                            "pipeline stage %r failed to send its tensors for sync %d",
                            self.group_tag,
                            version,
                        )
                        ok = False
                if stage == mine:
                    # The rest of the stage still flows (all of it after an earlier stage failed),
                    # so its TP peers finish their gathers and reach the agreement.
                    with contextlib.suppress(Exception):
                        for _ in remaining:
                            pass
                ok = await agree(ok)
        else:
            ok = False
        failure = ""
        if controller:
            # Close the session first (no engine keeps its update lock), then name the version
            # the engines now hold, then let them generate again.
            ends = await best_effort_on_all(
                self.engines, lambda e: call(e, "/end_weight_update", {}, timeout)
            )
            if ends:
                ok, failure = False, f"/end_weight_update failed on {sorted(ends)}: {ends}"
            try:
                if ok:
                    body = {"new_version": str(version)}
                    await on_all(self.engines, lambda e: call(e, "/update_weight_version", body, timeout))
            except Exception as exc:
                ok, failure = False, f"/update_weight_version: {exc}"
            if not ok:
                await self._restore()
            continues = await continue_all(self.engines, timeout)
            if ok and continues:
                ok, failure = False, f"/continue_generation failed on {sorted(continues)}: {continues}"
        if not ok:
            self._stale = True  # a broken collective leaves the group unusable: rebuild it
            raise SyncFailed(
                f"sync {version} failed in a pipeline stage"
                + (f" ({failure})" if failure else "; see the failing stage's log")
            )
        if not controller:
            return None
        pause_s = loop.time() - paused_at
        return await confirmed_entry(
            self.engines,
            timeout,
            version=version,
            transport=self.name,
            bytes_moved=moved * len(self.engines),
            pause_seconds=pause_s,
            perf_started=t0,
            started_at=started_at,
        )

"""The fully-async rollout worker: a warm worker that keeps groups in flight across training steps.

The head owns it (`async with FullyAsyncWorker(...) as worker:`; its tasks live in a TaskGroup
that `__aexit__` awaits). It keeps up to `max_in_flight` groups generating and draws a new group
whenever a slot opens, unless paused or the output queue already holds `max_in_flight` groups
(backpressure). Completed groups wait in the output queue; `get_batch(n, rollout_id)` hands over
`n` of them ordered by sample index. A group holding an ABORTED sample is requeued into the data
source (with its partial tokens under --partial-rollout, reset to its prompt otherwise). A group
whose oldest weight version lags the current one by more than --max-weight-staleness is dropped
(or requeued with --fully-async-requeue-stale-groups) and counted. `pause()` aborts what is in
flight and waits until nothing is; `resume(version)` carries on under the new weights.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tether.rollout.data.source import DataSource
from tether.rollout.rollout_fn import (
    RolloutContext,
    engine_failed,
    finalize_groups,
    generate_group,
    group_aborted,
    group_failed,
    keep_group,
    reset_to_prompt,
    rollout_metrics,
    sampling_params,
    using_context,
)
from tether.rollout.sample import Sample


class FullyAsyncMetrics(msgspec.Struct, kw_only=True):
    queue_length: int
    queue_age_seconds: float
    in_flight_groups: int
    aborted_groups: int
    requeued_groups: int
    filtered_groups: int
    failed_groups: int
    stale_dropped_groups: int
    stale_requeued_groups: int
    completed_groups: int
    handed_over_groups: int
    staleness_max: float
    staleness_mean: float

    def as_dict(self, prefix: str = "fully_async/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in msgspec.structs.asdict(self).items()}


_TRAILING_INT = re.compile(r"(\d+)$")


def weight_lag(group: Sequence[Sample], current: int | None) -> int | None:
    """How many versions the group's oldest segment lags `current` (None when versions are not integers)."""
    if current is None:
        return None
    oldest: int | None = None
    for s in group:
        for v in s.weight_versions:
            match = _TRAILING_INT.search(v)
            if match is None:
                return None  # versions that are not numbered cannot be compared
            n = int(match.group(1))
            oldest = n if oldest is None else min(oldest, n)
    return None if oldest is None else current - oldest


class FullyAsyncWorker:
    """See the module docstring. Not thread-safe: use it from the event loop that entered it."""

    def __init__(
        self,
        ctx: RolloutContext,
        data_source: DataSource,
        *,
        max_in_flight: int | None = None,
        weight_version: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ctx = ctx
        self._data = data_source
        self._cap = (
            max_in_flight or ctx.rollout.fully_async_max_groups_in_flight or ctx.data.rollout_batch_size
        )
        self._clock = clock
        self._params = sampling_params(ctx.rollout)
        self._version = weight_version
        self._queue: list[tuple[float, list[Sample]]] = []
        self._in_flight: dict[int, list[Sample]] = {}
        self._changed = asyncio.Condition()
        self._paused = False
        self._closing = False
        self._tg: asyncio.TaskGroup | None = None
        self._counts = dict.fromkeys(
            (
                "aborted_groups",
                "requeued_groups",
                "filtered_groups",
                "failed_groups",
                "stale_dropped_groups",
                "stale_requeued_groups",
                "completed_groups",
                "handed_over_groups",
            ),
            0,
        )
        self._last_lags: list[int] = []
        self._error: BaseException | None = None
        self._next_id = 0

    # ----- lifecycle -----
    async def __aenter__(self) -> FullyAsyncWorker:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._tg.create_task(self._draw_loop())
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self._shutdown()
        assert self._tg is not None
        await self._tg.__aexit__(exc_type, exc, tb)

    async def _shutdown(self) -> None:
        self._closing = True
        async with self._changed:
            self._changed.notify_all()
        if self._in_flight:
            self._ctx.stop.set()
            await self._abort_until_idle()

    @property
    def max_in_flight(self) -> int:
        return self._cap

    @property
    def weight_version(self) -> int | None:
        return self._version

    # ----- drawing and completing -----
    async def _draw_loop(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: (
                        self._closing
                        or (
                            not self._paused
                            and len(self._in_flight) < self._cap
                            and len(self._queue) < self._cap
                        )
                    )
                )
                if self._closing:
                    return
                group = self._data.get_samples(1)[0]
                key = self._next_id
                self._next_id += 1
                self._in_flight[key] = group
            assert self._tg is not None
            self._tg.create_task(self._run_group(key, group))

    async def _run_group(self, key: int, group: list[Sample]) -> None:
        try:
            with using_context(self._ctx):
                result = await generate_group(self._ctx, group, self._params)
        except Exception as exc:
            # Hand the failure to whoever waits for a batch, instead of leaving them waiting.
            async with self._changed:
                self._in_flight.pop(key, None)
                self._error = self._error or exc
                self._changed.notify_all()
            raise
        async with self._changed:
            del self._in_flight[key]
            self._settle(result)
            self._changed.notify_all()

    def _requeue(self, group: list[Sample]) -> None:
        if self._ctx.rollout.partial_rollout and not engine_failed(group):
            self._data.add_samples([group])
        else:
            self._data.add_samples([[reset_to_prompt(s) for s in group]])

    def _settle(self, group: list[Sample]) -> None:
        if group_aborted(group):
            self._counts["aborted_groups"] += 1
            self._counts["requeued_groups"] += 1
            self._requeue(group)
            return
        if group_failed(group):
            self._counts["failed_groups"] += 1
            return
        if self._is_stale(group):
            return
        keep, _ = keep_group(self._ctx, group)
        if not keep:
            self._counts["filtered_groups"] += 1
            return
        self._counts["completed_groups"] += 1
        self._queue.append((self._clock(), group))

    def _is_stale(self, group: list[Sample]) -> bool:
        """Drop or requeue (and count) a group that lags beyond --max-weight-staleness."""
        limit = self._ctx.rollout.max_weight_staleness
        lag = weight_lag(group, self._version)
        if limit is None or lag is None or lag <= limit:
            return False
        if self._ctx.rollout.fully_async_requeue_stale_groups:
            self._counts["stale_requeued_groups"] += 1
            self._data.add_samples([[reset_to_prompt(s) for s in group]])
        else:
            self._counts["stale_dropped_groups"] += 1
        return True

    # ----- hand-over -----
    async def get_batch(self, num_groups: int, rollout_id: int) -> list[list[Sample]]:
        """Wait for `num_groups` completed groups; the lowest sample indices first, validated."""
        if num_groups > self._cap:
            raise ValueError(f"a batch of {num_groups} groups can never fill a queue capped at {self._cap}")
        async with self._changed:
            while True:
                if self._error is not None:
                    raise self._error
                # versions may have moved on while groups waited in the queue
                fresh = [(t, g) for t, g in self._queue if not self._is_stale(g)]
                if len(fresh) != len(self._queue):
                    self._queue = fresh
                    self._changed.notify_all()
                if len(self._queue) >= num_groups:
                    break
                await self._changed.wait()
            self._queue.sort(key=lambda item: item[1][0].index or 0)
            taken, self._queue = self._queue[:num_groups], self._queue[num_groups:]
            self._changed.notify_all()
        groups = [g for _, g in taken]
        lags = [weight_lag(g, self._version) for g in groups]
        self._last_lags = [lag for lag in lags if lag is not None]
        self._counts["handed_over_groups"] += len(groups)
        group_size = None if self._ctx.generate_hook else self._ctx.data.n_samples_per_prompt
        groups = finalize_groups(self._ctx, groups, rollout_id, group_size=group_size)
        self._ctx.metrics = {
            **rollout_metrics(
                groups, self._ctx.rollout.reward_key, 0.0, log_passrate=self._ctx.rollout.log_passrate
            ),
            **self.metrics().as_dict(),
        }
        return groups

    # ----- weight updates -----
    async def pause(self) -> None:
        """Stop drawing, abort what is in flight (requeued), and return once nothing is in flight."""
        async with self._changed:
            self._paused = True
        self._ctx.stop.set()
        try:
            await self._abort_until_idle()
        finally:
            self._ctx.stop.clear()

    async def resume(self, weight_version: int | None = None) -> None:
        """Carry on drawing; `weight_version` is the version the engines now serve."""
        async with self._changed:
            if weight_version is not None:
                self._version = weight_version
            self._paused = False
            self._changed.notify_all()

    def set_weight_version(self, weight_version: int) -> None:
        self._version = weight_version

    async def _abort_until_idle(self, interval: float = 0.5) -> None:
        while self._in_flight:
            await self._ctx.router.abort_all()
            async with self._changed:
                try:
                    async with asyncio.timeout(interval):
                        await self._changed.wait_for(lambda: not self._in_flight)
                except TimeoutError:
                    pass  # abort again: a request may have reached its engine after the last abort

    # ----- checkpoints and metrics -----
    def unconsumed_groups(self) -> list[list[Sample]]:
        """Groups drawn but not handed over (in flight and queued), reset to their prompts.

        Save them with the data source position (`DataSource.save(path, pending=...)`) so a
        resume neither skips nor repeats them.
        """
        groups = [g for _, g in self._queue] + list(self._in_flight.values())
        return [[reset_to_prompt(s) for s in g] for g in groups]

    def metrics(self) -> FullyAsyncMetrics:
        now = self._clock()
        oldest = min((t for t, _ in self._queue), default=now)
        lags = self._last_lags
        return FullyAsyncMetrics(
            queue_length=len(self._queue),
            queue_age_seconds=now - oldest,
            in_flight_groups=len(self._in_flight),
            staleness_max=float(max(lags, default=0)),
            staleness_mean=(sum(lags) / len(lags)) if lags else 0.0,
            **self._counts,
        )

"""The head's rollout side: data source, rollout function, fully-async worker, eval, dumps.

One object gives the loops what they ask for (`generate`, or `get_batch`/`pause`/`resume`
for fully-async) and records, for every Sample, the weight versions that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from tether.config import Config
from tether.rollout.data.custom_source import (
    BlankDataSource,
    HookDataSource,
    build_custom_source,
    check_data_source_class,
    is_custom_source,
)
from tether.rollout.data.source import DataSource, DataSourceState, load_tokenizer
from tether.rollout.debug_dump import load_rollout, save_rollout, subsample
from tether.rollout.evaluation import run_evaluation, should_evaluate
from tether.rollout.fully_async import FullyAsyncWorker
from tether.rollout.hooks.calls import flat_args, load_function, maybe_await, slime_samples
from tether.rollout.hooks.default_rollout import generate_rollout
from tether.rollout.rollout_fn import (
    RolloutContext,
    multi_turn_metrics,
    reward_category_metrics,
    using_context,
)
from tether.rollout.routing.router import Router
from tether.rollout.sample import Sample
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.bridge import eval_data, eval_metrics, slime_evaluation, slime_rollout
from tether.rollout.slime_api.convert import uses_slime_api
from tether.runtime.process.gc_tuning import imports_without_gc

if TYPE_CHECKING:
    from tether.rollout.routing.front import RouterFront

Groups = list[list[Sample]]


class RolloutInputs(NamedTuple):
    """What the rollout side reads before its first rollout: the tokenizer and the prompts."""

    tokenizer: Any
    data: DataSource | None


def load_rollout_inputs(config: Config) -> RolloutInputs:
    """Tokenizer and prompts: seconds of blocking work, so never on the head's event loop
    (agents on other nodes count a stalled loop's missed heartbeats). No prompts where every
    rollout is a saved one or a --data-source-path class serves them (built on entry, with the
    hooks' args)."""
    tokenizer: Any = None
    if config.rollout.hf_checkpoint is not None:
        with imports_without_gc():  # transformers' import, most of this load
            tokenizer = load_tokenizer(config.rollout.hf_checkpoint)
        if config.debug.dump_details is not None:  # slime's layout: the tokenizer beside the dumps
            tokenizer.save_pretrained(str(Path(config.debug.dump_details) / "tokenizer"))
    if replays_saved_rollouts(config) or is_custom_source(config.rollout.data_source_path):
        return RolloutInputs(tokenizer, None)
    if config.data.disable_rollout_global_dataset:
        return RolloutInputs(
            tokenizer, BlankDataSource(n_samples_per_prompt=config.data.n_samples_per_prompt)
        )
    return RolloutInputs(tokenizer, DataSource.from_config(config.data, config.rollout, tokenizer))


def replays_saved_rollouts(config: Config) -> bool:
    """Every rollout is a saved one (--debug-train-only with --load-debug-rollout-data): no data
    source, no context."""
    return config.debug.debug_train_only and config.debug.load_debug_rollout_data is not None


def version_lags(groups: Groups, current: int) -> list[int]:
    """Per sample: how many versions its oldest generating weights lag behind `current`.

    Engines report the weights they started with by a non-numeric name ("default"): version 0.
    """
    lags = []
    for group in groups:
        for sample in group:
            versions = [int(v) if str(v).isdigit() else 0 for v in sample.weight_versions]
            if versions:
                lags.append(current - min(versions))
    return lags


def own_eval_metrics(path: str, result: object, data_out: dict[str, Any] | None) -> dict[str, float]:
    """What a tether-API evaluation function returned: a dict of figures (tether's default returns
    its `eval/...` metrics) or, like a slime one, data by dataset name."""
    if isinstance(result, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in result.values()
    ):
        return {str(k): float(v) for k, v in result.items()}
    metrics = eval_metrics(path, result)
    if data_out is not None:
        data_out.update(eval_data(result))
    return metrics


class RolloutManager:
    """Owns the rollout context (router, rewards, hooks), the data source position, and the router
    front hooks reach the engines through (`args.sglang_router_ip`/`_port`)."""

    def __init__(
        self, config: Config, router: Router | None, inputs: asyncio.Future[RolloutInputs] | None = None
    ) -> None:
        """`inputs`: the tokenizer and prompts, already loading (`load_rollout_inputs` on a
        thread, started while the engines start); else they are loaded on entry."""
        self.config = config
        self._inputs = inputs
        self.tokenizer: Any = None
        self.data: DataSource | None = None  # loaded on entry, off the event loop
        self._replays = replays_saved_rollouts(config)
        if router is None and config.debug.debug_train_only and not self._replays:
            # slime's --debug-train-only with a rollout function that generates nothing (its SFT
            # rollout): the data source and hooks run, and no engine ever will.
            router = Router(
                engineless="--debug-train-only: no engines run, so the rollout function cannot generate "
                "(slime.rollout.sft_rollout.generate_rollout needs none)"
            )
        self.router = router
        self.ctx: RolloutContext | None = None
        self.worker: FullyAsyncWorker | None = None
        self.weight_version = 0
        self.metrics: dict[str, float] = {}
        self._hooks: dict[str, Any] = {}
        self._positions: dict[int, dict[str, Any]] = {}
        self._rollout_fn = generate_rollout
        self._rollout_path = (
            config.rollout.rollout_function_path or "tether.rollout.hooks.default_rollout.generate_rollout"
        )
        if config.rollout.rollout_function_path:
            self._rollout_fn = load_function(config.rollout.rollout_function_path, "--rollout-function-path")
        self._slime_rollout = uses_slime_api(self._rollout_fn)
        """The rollout function is written against slime's API: slime Samples, slime's return shapes."""
        self.front: RouterFront | None = None
        self._stack = contextlib.AsyncExitStack()
        self._source_loaded = False
        """--data-source-path: whether the class's `load(start_rollout_id - 1)` has been called."""
        self._early: tuple[int, asyncio.Task[tuple[Groups, float]]] | None = None
        """A rollout started before the loop asked for it (`start_early`), with its id."""
        self._before_early: dict[str, Any] | None = None
        """The data position before a speculative early rollout drew its prompts."""

    async def __aenter__(self) -> RolloutManager:
        inputs = self._inputs
        if inputs is None:
            inputs = asyncio.ensure_future(asyncio.to_thread(load_rollout_inputs, self.config))
        self.tokenizer, self.data = await inputs
        if self.router is not None:
            # Imported here, with aiohttp's server: not before the head starts its processes.
            from tether.rollout.routing.front import RouterFront

            # The front serves from before the context exists (hooks' args carry its address) and
            # stops before the context closes the router.
            front = RouterFront(self.router)
            await front.__aenter__()
            try:
                extra = slime_args(self.config, router_ip=front.host, router_port=front.port)
                self.ctx = await self._stack.enter_async_context(
                    # Built in a thread: it imports the user's hook modules.
                    await asyncio.to_thread(
                        RolloutContext, self.config, self.router, tokenizer=self.tokenizer, args_extra=extra
                    )
                )
            except BaseException:
                await front.__aexit__(None, None, None)
                raise
            self._stack.push_async_exit(front)
            self.front = front
            front.abort_when(self.ctx.stop)
            path = self.config.rollout.data_source_path
            if is_custom_source(path) and not self._replays:
                assert path is not None
                self.data = await asyncio.to_thread(
                    build_custom_source,
                    check_data_source_class(path),
                    self.ctx.args,
                    path=path,
                    n_samples_per_prompt=self.config.data.n_samples_per_prompt,
                    tokenizer=self.tokenizer,
                    global_dataset=not self.config.data.disable_rollout_global_dataset,
                )
            if self.data is not None:
                self.data.buffer_filter = self.ctx.buffer_filter
        return self

    async def __aexit__(self, *exc: object) -> None:
        early, self._early = self._early, None
        if early is not None:  # never taken: the run ended before its first step
            task = early[1]
            task.cancel()
            await asyncio.wait([task])  # its outcome is moot; a cancellation of this exit is not
            if not task.cancelled():
                task.exception()  # retrieved, so that a failed rollout is not reported as lost
        await self._stack.aclose()

    async def start_early(self, rollout_id: int, *, speculative: bool = False) -> None:
        """Start rollout `rollout_id` now, before the loop asks for it: while the trainer ranks
        start, on weights the engines already serve (the caller's to know, see
        `tether.run.job.starts_rollout_early`). The loop's `generate` (or, fully async, the warm
        worker's first batch) then takes it; an exit before that cancels it.

        `speculative`: on weights the trainer may not start from (`tether.run.job.
        speculates_rollout_early`); the caller then takes it as it is or `discard_early`s it.
        Nothing of it shows (rollout log hook, debug dump, metrics) before the loop takes it."""
        if speculative:
            if self.config.run.loop == "fully-async":
                raise ValueError("a speculative early rollout cannot be a fully-async worker's")
            self._before_early = self.position()
        if self.config.run.loop == "fully-async":
            await self._start_worker(rollout_id)  # it draws ahead as soon as it runs
        elif self._early is None:
            self._early = (rollout_id, asyncio.create_task(self._produce(rollout_id)))

    @property
    def speculative_early(self) -> int | None:
        """The id of the speculative early rollout not taken or discarded yet, else None."""
        return self._early[0] if self._early is not None and self._before_early is not None else None

    async def discard_early(self) -> bool:
        """Cancel the early rollout and put back everything it drew (the data source's position,
        its buffer); False when there was none. Its requests still on the engines are aborted."""
        early, self._early = self._early, None
        before, self._before_early = self._before_early, None
        if early is None:
            return False
        rollout_id, task = early
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: its outcome is moot
        if self.router is not None:
            await self.router.abort_all()
        self._positions.pop(rollout_id, None)
        if before is not None:
            self.load_position(before)
        self.metrics = {}
        return True

    # ----- what the loops call -----
    async def generate(self, rollout_id: int) -> Groups:
        early = self._early
        if early is not None:
            self._early = self._before_early = None
            if early[0] != rollout_id:  # a start the caller got wrong: nothing of it may be trained
                early[1].cancel()
                raise RuntimeError(
                    f"rollout {early[0]} was started early, but the loop began at {rollout_id}"
                )
            groups, seconds = await early[1]
        else:
            groups, seconds = await self._produce(rollout_id)
        self._after_rollout(rollout_id, groups, seconds)
        return groups

    async def _produce(self, rollout_id: int) -> tuple[Groups, float]:
        """Rollout `rollout_id`'s groups and the seconds they took; `generate` reports them."""
        debug = self.config.debug
        started = time.monotonic()
        if debug.load_debug_rollout_data is not None:
            dump = load_rollout(debug.load_debug_rollout_data, rollout_id)
            groups = dump.groups
            if debug.load_debug_rollout_data_subsample is not None:
                groups = subsample(groups, debug.load_debug_rollout_data_subsample)
            self.metrics = dict(dump.metrics)
        else:
            assert self.ctx is not None and self.data is not None
            await self._load_source(rollout_id)
            with using_context(self.ctx):
                if self._slime_rollout:
                    result, self.ctx.metrics = await slime_rollout(
                        self._rollout_fn, self.ctx, rollout_id, self.data, path=self._rollout_path
                    )
                else:
                    result = await maybe_await(self._rollout_fn(self.ctx.args, rollout_id, self.data))
            if not isinstance(result, list):
                raise TypeError(
                    f"--rollout-function-path returned {type(result).__name__}, expected a list of sample groups"
                )
            groups = result
            self.metrics = dict(self.ctx.metrics)
            # The position a checkpoint after this step records: taken now, because in the
            # async loop the next rollout draws prompts before this step ends.
            self._positions[rollout_id] = self.position()
        return groups, time.monotonic() - started

    async def _start_worker(self, rollout_id: int) -> None:
        # Started by the first step (or `start_early`), not on entry: a resume loads the data
        # position first, and the warm worker must draw from there (it draws ahead as soon as it runs).
        if self.worker is None:
            assert self.ctx is not None and self.data is not None
            await self._load_source(rollout_id)
            self.worker = await self._stack.enter_async_context(
                FullyAsyncWorker(self.ctx, self.data, weight_version=self.weight_version)
            )

    async def get_batch(self, rollout_id: int) -> Groups:
        await self._start_worker(rollout_id)
        assert self.worker is not None
        started = time.monotonic()
        groups = await self.worker.get_batch(self.config.data.rollout_batch_size, rollout_id)
        assert self.ctx is not None
        self.metrics = dict(self.ctx.metrics)
        self._after_rollout(rollout_id, groups, time.monotonic() - started)
        return groups

    async def pause(self) -> None:
        if self.worker is not None:
            await self.worker.pause()

    async def resume(self, weight_version: int | None) -> None:
        if weight_version is not None:
            self.weight_version = weight_version
        if self.worker is not None:
            await self.worker.resume(weight_version)

    async def _load_source(self, rollout_id: int) -> None:
        """A --data-source-path class loads its state once, before the first rollout of this run,
        as slime calls it: `load(start_rollout_id - 1)`."""
        if isinstance(self.data, HookDataSource) and not self._source_loaded:
            self._source_loaded = True
            await asyncio.to_thread(self.data.load_at, rollout_id - 1)

    async def save_source(self, rollout_id: int) -> None:
        """At a checkpoint of step `rollout_id`: a --data-source-path class saves its state
        (`save(rollout_id)`, as slime calls it); tether's own position travels in the checkpoint."""
        if isinstance(self.data, HookDataSource):
            await asyncio.to_thread(self.data.save_at, rollout_id)

    def _after_rollout(self, rollout_id: int, groups: Groups, seconds: float) -> None:
        samples = sum(len(g) for g in groups)
        self.metrics.update({"rollout/wait_s": seconds, "rollout/samples": float(samples)})
        if self.router is not None:
            self.metrics["perf/engine_busy_s_total"] = sum(self.router.busy_seconds().values())
        cfg = self.config.rollout
        flat = [s for g in groups for s in g]
        if cfg.log_multi_turn:
            self.metrics.update(multi_turn_metrics(flat, cfg.rollout_max_response_len))
        if cfg.log_reward_category is not None:
            self.metrics.update(reward_category_metrics(flat, cfg.log_reward_category))
        log_hook = self._hook("custom_rollout_log_function_path")
        if log_hook is not None and log_hook(
            rollout_id, self._hook_args(), slime_samples(flat), dict(self.metrics), seconds
        ):
            # slime's meaning of a True return: the hook logged the rollout; the default figures are not
            self.metrics = {k: v for k, v in self.metrics.items() if not k.startswith(("rollout/", "perf/"))}
        if self.config.debug.save_debug_rollout_data is not None:
            save_rollout(self.config.debug.save_debug_rollout_data, rollout_id, groups, metrics=self.metrics)

    def _hook(self, field: str) -> Any:
        """The hook a rollout `*_path` flag names, loaded once; None when unset."""
        path = getattr(self.config.rollout, field)
        if path is None:
            return None
        if field not in self._hooks:
            self._hooks[field] = load_function(path, "--" + field.replace("_", "-"))
        return self._hooks[field]

    def _hook_args(self) -> Any:
        return self.ctx.args if self.ctx is not None else flat_args(self.config)

    # ----- evaluation and checkpoints -----
    @property
    def _evaluates(self) -> bool:
        return self.ctx is not None and not self.config.debug.debug_train_only

    def eval_due(self, rollout_id: int) -> bool:
        # slime does not evaluate under --debug-train-only: there are no engines.
        has_data = self._evaluates and bool(self.config.data.eval_datasets())
        return should_evaluate(self.config.data.eval_interval, rollout_id, has_data=has_data)

    def eval_before_train(self) -> bool:
        """slime evaluates once before the first step unless --skip-eval-before-train."""
        data = self.config.data
        return (
            self._evaluates
            and bool(data.eval_datasets())
            and data.eval_interval is not None
            and not data.skip_eval_before_train
        )

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        assert self.ctx is not None
        with using_context(self.ctx):
            log_hook = self._hook("custom_eval_rollout_log_function_path")
            data: dict[str, Any] | None = {} if log_hook is not None else None
            eval_path = self.config.rollout.eval_function_path
            if eval_path is not None:  # slime's --eval-function-path: called with evaluation=True
                fn = self._hook("eval_function_path")
                if uses_slime_api(fn):
                    metrics = await slime_evaluation(
                        fn, self.ctx, rollout_id, self.data, path=eval_path, data_out=data
                    )
                else:
                    result = await maybe_await(fn(self.ctx.args, rollout_id, self.data, evaluation=True))
                    metrics = own_eval_metrics(eval_path, result, data)
            elif self._slime_rollout:  # slime evaluates with the rollout function (evaluation=True)
                metrics = await slime_evaluation(
                    self._rollout_fn, self.ctx, rollout_id, self.data, path=self._rollout_path, data_out=data
                )
            else:
                metrics = await run_evaluation(self.ctx, rollout_id, data)
        if log_hook is not None and log_hook(rollout_id, self._hook_args(), data, dict(metrics)):
            return {}  # slime's meaning of a True return: the hook logged the evaluation
        means = [v for k, v in metrics.items() if k.endswith("/reward_mean")]
        if means:  # the headline figure across every eval dataset
            metrics["eval/reward_mean"] = sum(means) / len(means)
        return metrics

    def position(self) -> dict[str, Any]:
        """The data source position now, with drawn-but-unconsumed groups put back first."""
        if self.data is None:
            return {}
        pending = self.worker.unconsumed_groups() if self.worker is not None else []
        return msgspec.to_builtins(self.data.state_dict(pending=pending))

    def position_after(self, rollout_id: int) -> dict[str, Any]:
        """The data position at the end of step `rollout_id`: every prompt of that step and of
        the steps before it drawn, none of a later step's (the fully-async worker puts back what
        it drew ahead)."""
        position = self._positions.get(rollout_id)
        for done in [r for r in self._positions if r <= rollout_id]:
            del self._positions[done]
        return position if position is not None else self.position()

    def load_position(self, position: dict[str, Any]) -> None:
        if self.data is not None and position:
            self.data.load_state_dict(msgspec.convert(position, DataSourceState))

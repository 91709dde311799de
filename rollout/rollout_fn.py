"""One rollout with slime's semantics, and the per-sample and per-group steps it is built from.

`run_rollout` is what the default rollout function (tether.rollout.hooks.default_rollout) runs. The
live objects it needs (router, reward model, hooks) travel in a `RolloutContext` that the rollout
manager installs with `using_context(ctx)`; a context variable, not a global, so two managers in
one process (or a test) do not see each other's. Custom hooks reach the router the same way,
through `current_context()`.

One rollout: draw --over-sampling-batch-size groups whenever the groups done plus in flight fall
below --rollout-batch-size; generate every sample of a group (concurrency capped per engine by the
router), score the group, keep it if the dynamic filter does; once the batch is full, abort the
surplus in flight. Aborted groups go back to the data source with their tokens when
--partial-rollout is on (continued next round, one weight_versions entry per segment), otherwise
they are dropped and counted. The result is validated groups ordered by sample index.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import EllipsisType
from typing import Any

import msgspec

from tether.rollout.config import DataConfig, MoeRouting, RolloutConfig, moe_routing
from tether.rollout.data.source import DataSource
from tether.rollout.engine_api.client import EngineResponseError, EngineUnavailable, GenerateResponse
from tether.rollout.hooks.calls import (
    BufferFilter,
    FlatArgs,
    HookError,
    buffer_filter,
    call_filter,
    call_generate_hook,
    call_sample_hook,
    keep_slime_changes,
    load_function,
    slime_samples,
)
from tether.rollout.rewards.scoring import RewardModel
from tether.rollout.routing.router import NoEngineError, Router
from tether.rollout.sample import (
    TRAINABLE,
    Sample,
    SampleContractError,
    SampleStatus,
    validate_group,
    validate_sample,
)

SEGMENTS_KEY = "segment_lengths"
"""Sample.metadata key: tokens per generation segment, aligned with weight_versions."""


class RolloutContext:
    """What a rollout needs besides its config: the router, the reward model, the loaded hooks.

    `args_extra`: names the hooks' `args` answer beyond the config's fields (slime's flag names
    and the router front's address; see `tether.rollout.slime_api.args`).
    """

    def __init__(
        self,
        config: Any,
        router: Router,
        *,
        reward_model: RewardModel | None = None,
        tokenizer: Any = None,
        args_extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        """The model's tokenizer, for hooks that insert text (tool observations); may be None."""
        self.args: FlatArgs = FlatArgs(config, extra=args_extra)
        self.rollout: RolloutConfig = config.rollout
        self.data: DataConfig = config.data
        self.router = router
        self.reward_model = reward_model or RewardModel(self.rollout, self.args)
        cfg = self.rollout
        self.generate_hook: tuple[Callable[..., Any], str] | None = None
        if cfg.custom_generate_function_path:
            path = cfg.custom_generate_function_path
            self.generate_hook = (load_function(path, "--custom-generate-function-path"), path)
        self.filter_hook: tuple[Callable[..., Any], str] | None = None
        if cfg.dynamic_sampling_filter_path:
            path = cfg.dynamic_sampling_filter_path
            self.filter_hook = (load_function(path, "--dynamic-sampling-filter-path"), path)
        self.sample_hooks = [
            (load_function(path, "--rollout-sample-hook-path"), path)
            for path in getattr(cfg, "rollout_sample_hook_path", None) or []
        ]
        self.sample_filter_hook = _optional_hook(cfg, "rollout_sample_filter_path")
        self.all_samples_hook = _optional_hook(cfg, "rollout_all_samples_process_path")
        self.buffer_filter: BufferFilter | None = None
        """--buffer-filter-path as the data source calls it (`DataSource.buffer_filter`)."""
        path = getattr(cfg, "buffer_filter_path", None)
        if path:
            self.buffer_filter = buffer_filter(load_function(path, "--buffer-filter-path"), path, self.args)
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop the context was entered on: hooks running in threads schedule coroutines here."""
        self.resources = contextlib.AsyncExitStack()
        """Closed when the context exits: what hook APIs opened for it (HTTP sessions, tasks)."""
        self.extensions: dict[str, Any] = {}
        """Per-context state of hook APIs (slime's GenerateState, say), by a key of their own."""
        self.metrics: dict[str, float] = {}
        """Metrics of the latest rollout (read by the manager after each call)."""
        self.stop = asyncio.Event()
        fault_tolerance = getattr(config, "fault_tolerance", None)
        self.fault_tolerant = bool(fault_tolerance is not None and fault_tolerance.use_fault_tolerance)
        """Engine faults abort and requeue the samples they cut off instead of failing the rollout."""
        """Set while surplus requests are being aborted: samples not yet sent are not sent."""

    async def __aenter__(self) -> RolloutContext:
        self.loop = asyncio.get_running_loop()
        await self.reward_model.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # the context owns the router's connection pools and the reward model's session
        try:
            await self.resources.aclose()
        finally:
            try:
                await self.reward_model.__aexit__(*exc)
            finally:
                await self.router.close()


def _optional_hook(cfg: Any, field: str) -> tuple[Callable[..., Any], str] | None:
    """The hook a `*_path` flag names, loaded, with its path; None when the flag is unset."""
    path = getattr(cfg, field, None)
    if not path:
        return None
    return load_function(path, "--" + field.replace("_", "-")), path


ENGINE_FAILURE = "tether_engine_failure"
"""Metadata key set on a sample cut off by an engine fault (the group is requeued whole)."""

_current: contextvars.ContextVar[RolloutContext] = contextvars.ContextVar("tether_rollout_context")


def current_context() -> RolloutContext:
    """The RolloutContext installed by the caller (hooks use it to reach the router)."""
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError("no RolloutContext is installed; call inside `with using_context(ctx):`") from None


@contextmanager
def using_context(ctx: RolloutContext) -> Iterator[RolloutContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


# ----- sampling parameters -----
def sampling_params(cfg: RolloutConfig, *, evaluation: DataConfig | None = None) -> dict[str, Any]:
    """SGLang sampling_params from the config (the eval overrides when `evaluation` is given)."""
    temperature, top_p, top_k, max_new = (
        cfg.rollout_temperature,
        cfg.rollout_top_p,
        cfg.rollout_top_k,
        cfg.rollout_max_response_len,
    )
    if evaluation is not None:
        temperature = evaluation.eval_temperature if evaluation.eval_temperature is not None else temperature
        top_p = evaluation.eval_top_p if evaluation.eval_top_p is not None else top_p
        top_k = evaluation.eval_top_k if evaluation.eval_top_k is not None else top_k
        max_new = evaluation.eval_max_response_len or max_new
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "skip_special_tokens": cfg.rollout_skip_special_tokens,
        "no_stop_trim": True,  # the matched stop token stays in the tokens the trainer sees
        "spaces_between_special_tokens": False,
    }
    if max_new is not None:
        params["max_new_tokens"] = max_new
    if cfg.rollout_stop:
        params["stop"] = list(cfg.rollout_stop)
    if cfg.rollout_stop_token_ids:
        params["stop_token_ids"] = list(cfg.rollout_stop_token_ids)
    return params


# ----- one sample -----
def append_segment(
    sample: Sample,
    tokens: Sequence[int],
    log_probs: Sequence[float],
    text: str,
    weight_version: str | None,
    *,
    mask_offpolicy: bool = False,
) -> None:
    """Append one generation segment to `sample`; with `mask_offpolicy`, older segments stop training."""
    if len(tokens) != len(log_probs):
        raise ValueError(f"segment has {len(tokens)} tokens but {len(log_probs)} log-probs")
    if not tokens:
        return
    sample.extend_response(tokens, text, log_probs=log_probs)
    sample.weight_versions.append(weight_version if weight_version is not None else "")
    segments = [*sample.metadata.get(SEGMENTS_KEY, []), len(tokens)]
    sample.metadata[SEGMENTS_KEY] = segments
    if mask_offpolicy and len(segments) > 1:
        # Only the tokens from the weights that finished the sample are on-policy.
        latest = sample.weight_versions[-1]
        mask, logps = list(sample.loss_mask or []), list(sample.rollout_log_probs or [])
        pos = 0
        for version, length in zip(sample.weight_versions, segments, strict=True):
            if version != latest:
                for i in range(pos, pos + length):
                    mask[i] = 0
                    logps[i] = 0.0
            pos += length
        sample.loss_mask, sample.rollout_log_probs = mask, logps


def reset_to_prompt(sample: Sample) -> Sample:
    """The sample as it was drawn: prompt tokens only, no response, pending."""
    metadata = {k: v for k, v in sample.metadata.items() if k not in (SEGMENTS_KEY, ENGINE_FAILURE)}
    return msgspec.structs.replace(
        sample,
        tokens=sample.tokens[: sample.prompt_length],
        response="",
        response_length=0,
        reward=None,
        loss_mask=None,
        rollout_log_probs=None,
        rollout_routed_experts=None,
        status=SampleStatus.PENDING,
        weight_versions=[],
        metadata=metadata,
    )


ROLLOUT_ROUTING_KEY = "tether.rollout_routing"
"""RolloutContext.extensions key: the routed-experts shape R3 asks the engines for (or None)."""


def rollout_routing(ctx: RolloutContext) -> MoeRouting | None:
    """With --use-rollout-routing-replay, the shape of the routed experts the engines return for
    this model (read from its HF config once per context); None otherwise."""
    if ROLLOUT_ROUTING_KEY not in ctx.extensions:
        on = bool(getattr(ctx.args, "use_rollout_routing_replay", False))
        hf = ctx.rollout.hf_checkpoint
        ctx.extensions[ROLLOUT_ROUTING_KEY] = moe_routing(hf) if on and hf else None
    routing: MoeRouting | None = ctx.extensions[ROLLOUT_ROUTING_KEY]
    return routing


def take_routed_experts(
    sample: Sample, resp: GenerateResponse, routing: MoeRouting, *, required: bool = True
) -> None:
    """Put the engine's routed experts of `resp` on `sample` (after its tokens were appended);
    `required`: an answer without them is an error (an aborted one may lack them)."""
    got = resp.routed_experts()
    if got is None:
        if required:
            raise EngineResponseError(
                "--use-rollout-routing-replay: the engine returned no meta_info.routed_experts "
                "(it must record them: SGLang's --enable-return-routed-experts)"
            )
        return
    flat, start = got
    sample.update_routed_experts(flat, start, routing.layers, routing.topk)


async def generate_one(
    ctx: RolloutContext,
    sample: Sample,
    params: dict[str, Any],
    *,
    max_context_len: int | EllipsisType | None = ...,
    batch_key: Hashable | None = None,
) -> Sample:
    """The default generate: continue `sample` on an engine by one segment until it stops or is aborted.

    `max_context_len`: the cap on prompt plus response tokens (default: --rollout-max-context-len;
    evaluation passes its own). `batch_key`: the samples generated together under one key (a
    group's) reach their engine in one batched request (Router.generate)."""
    cfg = ctx.rollout
    context_cap = cfg.rollout_max_context_len if max_context_len is ... else max_context_len
    if ctx.stop.is_set():
        sample.status = SampleStatus.ABORTED
        return sample
    params = dict(params)
    limit = params.get("max_new_tokens")
    if limit is not None:
        remaining = int(limit) - sample.response_length
        if context_cap is not None:
            remaining = min(remaining, context_cap - len(sample.tokens))
        if remaining <= 0:
            sample.status = SampleStatus.TRUNCATED
            return sample
        params["max_new_tokens"] = remaining
    routing = rollout_routing(ctx)
    try:
        _, resp = await ctx.router.generate(
            sample.tokens,
            params,
            routing_key=sample.session_id,
            return_routed_experts=routing is not None,
            batch_key=batch_key,
        )
    except (EngineUnavailable, NoEngineError) as exc:
        if not ctx.fault_tolerant:
            raise
        # The engine died or is being replaced: this sample goes back with its group, whole.
        sample.status = SampleStatus.ABORTED
        sample.metadata[ENGINE_FAILURE] = str(exc)
        if isinstance(exc, NoEngineError):
            await ctx.router.wait_for_engine()
        return sample
    append_segment(
        sample,
        resp.output_ids,
        resp.log_probs(),
        resp.text,
        resp.weight_version,
        mask_offpolicy=cfg.mask_offpolicy_in_partial_rollout,
    )
    finish = resp.finish_type
    if routing is not None:
        take_routed_experts(sample, resp, routing, required=finish != "abort")
    if finish == "abort":
        sample.status = SampleStatus.ABORTED
    elif finish == "length":
        sample.status = SampleStatus.TRUNCATED
    elif sample.response_length == 0:
        sample.status = SampleStatus.FAILED  # an engine that stops without a token gave nothing to train on
    else:
        sample.status = SampleStatus.COMPLETED
    return sample


async def generate_sample(
    ctx: RolloutContext,
    sample: Sample,
    params: dict[str, Any],
    *,
    evaluation: bool = False,
    generate_hook: tuple[Callable[..., Any], str] | EllipsisType | None = ...,
    max_context_len: int | EllipsisType | None = ...,
    batch_key: Hashable | None = None,
) -> list[Sample]:
    """One sample through the custom generate hook (checked) or the default generate.

    `evaluation` reaches a slime-API hook whose signature takes it, as slime passes it;
    `batch_key` reaches the default generate."""
    hook = ctx.generate_hook if generate_hook is ... else generate_hook
    if hook is not None:
        if ctx.stop.is_set():
            sample.status = SampleStatus.ABORTED
            return [sample]
        fn, path = hook
        out = await call_generate_hook(fn, path, ctx.args, sample, params, evaluation=evaluation)
    else:
        out = [await generate_one(ctx, sample, params, max_context_len=max_context_len, batch_key=batch_key)]
    for fn, path in ctx.sample_hooks:  # --rollout-sample-hook-path, in order, before the reward
        out = [
            await call_sample_hook(fn, path, ctx.args, s, rollout_id=s.rollout_id, evaluation=evaluation)
            for s in out
        ]
    return out


def _unfinished(sample: Sample) -> bool:
    return sample.status in (SampleStatus.PENDING, SampleStatus.ABORTED)


async def generate_group(
    ctx: RolloutContext,
    group: list[Sample],
    params: dict[str, Any],
    *,
    score: bool = True,
    evaluation: bool = False,
    generate_hook: tuple[Callable[..., Any], str] | EllipsisType | None = ...,
    reward_model: RewardModel | None = None,
    max_context_len: int | EllipsisType | None = ...,
) -> list[Sample]:
    """Generate every unfinished sample of a group concurrently, then score the group (unless aborted).

    Evaluation datasets pass their own `generate_hook`, `reward_model` and `max_context_len`
    (default: the rollout's). The group's prompts go to an engine in one batched request: the
    group is scored only once its last sample is back, so none of them waits for anything more."""
    batch_key = object()
    async with asyncio.TaskGroup() as tg:
        tasks = [
            (
                s,
                tg.create_task(
                    generate_sample(
                        ctx,
                        s,
                        params,
                        evaluation=evaluation,
                        generate_hook=generate_hook,
                        max_context_len=max_context_len,
                        batch_key=batch_key,
                    )
                )
                if _unfinished(s)
                else None,
            )
            for s in group
        ]
    out: list[Sample] = []
    for sample, task in tasks:
        out.extend(task.result() if task is not None else [sample])
    if any(s.status == SampleStatus.ABORTED for s in out):
        return out
    if score and all(s.status in TRAINABLE for s in out):
        await (reward_model or ctx.reward_model).score_group(out)
    return out


def group_aborted(group: Sequence[Sample]) -> bool:
    return any(s.status == SampleStatus.ABORTED for s in group)


def engine_failed(group: Sequence[Sample]) -> bool:
    """Some sample of the group was cut off by an engine fault (see --use-fault-tolerance)."""
    return any(ENGINE_FAILURE in s.metadata for s in group)


def group_failed(group: Sequence[Sample]) -> bool:
    return any(s.status == SampleStatus.FAILED for s in group)


def keep_group(
    ctx: RolloutContext, group: Sequence[Sample], *, insufficient: bool = False
) -> tuple[bool, str | None]:
    """The dynamic filter's verdict; `insufficient`: dropping the group would leave the batch short."""
    if ctx.filter_hook is None:
        return True, None
    fn, path = ctx.filter_hook
    return call_filter(fn, path, ctx.args, group, insufficient=insufficient)


def finalize_groups(
    ctx: RolloutContext, groups: list[list[Sample]], rollout_id: int, *, group_size: int | None
) -> list[list[Sample]]:
    """Set rollout_id, order by sample index, and validate every group (the contract at hand-over)."""
    for group in groups:
        for s in group:
            s.rollout_id = rollout_id
        group.sort(key=lambda s: s.index if s.index is not None else -1)
    groups.sort(key=lambda g: g[0].index if g and g[0].index is not None else -1)
    where = ctx.rollout.custom_generate_function_path or "rollout"
    for group in groups:
        try:
            validate_group(group, group_size or len(group))
            for s in group:
                validate_sample(s)
        except SampleContractError as exc:
            raise HookError(where, str(exc), field=exc.field) from exc
    return groups


# ----- one rollout -----
async def run_rollout(ctx: RolloutContext, rollout_id: int, data_source: DataSource) -> list[list[Sample]]:
    """The default synchronous rollout: a full batch of kept groups; see the module docstring."""
    cfg, data = ctx.rollout, ctx.data
    target = data.rollout_batch_size
    over = cfg.over_sampling_batch_size or target
    params = sampling_params(cfg)
    started = time.monotonic()
    kept: list[list[Sample]] = []
    counts = dict.fromkeys(
        (
            "filtered_groups",
            "aborted_groups",
            "surplus_groups",
            "requeued_partial_groups",
            "failed_groups",
            "requeued_engine_failure_groups",
        ),
        0,
    )
    reasons: dict[str, int] = {}
    finished: list[list[Sample]] = []
    """Every group that finished (kept, filtered out, surplus): what --rollout-all-samples-process-path sees."""
    ctx.stop.clear()

    def settle(group: list[Sample], in_flight: int) -> None:
        if engine_failed(group):
            # Lost to an engine fault, not to the sampler: the prompt goes back whole, so it is
            # generated again and trained exactly once.
            data_source.add_samples([[reset_to_prompt(s) for s in group]])
            counts["requeued_engine_failure_groups"] += 1
            return
        if group_aborted(group):
            counts["aborted_groups"] += 1
            if cfg.partial_rollout:
                data_source.add_samples([group])
                counts["requeued_partial_groups"] += 1
            return
        if group_failed(group):
            counts["failed_groups"] += 1
            return
        finished.append(group)
        if len(kept) >= target:
            # finished after the batch was full: keep its work for the next round when allowed
            counts["surplus_groups"] += 1
            if cfg.partial_rollout:
                data_source.add_samples([group])
                counts["requeued_partial_groups"] += 1
            return
        keep, reason = keep_group(ctx, group, insufficient=len(kept) + in_flight + 1 <= target)
        if keep:
            kept.append(group)
        else:
            counts["filtered_groups"] += 1
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1

    try:
        await _fill(ctx, rollout_id, data_source, params, target, over, kept, settle)
    except BaseExceptionGroup as group:
        raise first_error(group) from group
    ctx.stop.clear()
    groups = finalize_groups(
        ctx, kept[:target], rollout_id, group_size=None if ctx.generate_hook else data.n_samples_per_prompt
    )
    after_rollout_hooks(ctx, groups, finished, data_source)
    ctx.metrics = rollout_metrics(
        groups, cfg.reward_key, time.monotonic() - started, log_passrate=cfg.log_passrate
    )
    ctx.metrics.update({f"rollout/{k}": float(v) for k, v in counts.items()})
    ctx.metrics.update({f"rollout/dynamic_filter/{k}": float(v) for k, v in reasons.items()})
    ctx.metrics["rollout/dropped_long_prompts"] = float(data_source.dropped_long_prompts)
    return groups


def after_rollout_hooks(
    ctx: RolloutContext,
    groups: list[list[Sample]],
    finished: list[list[Sample]],
    data_source: DataSource,
) -> None:
    """slime's two hooks at the end of its default rollout, in its order: the sample filter over the
    kept groups (`remove_sample` zeroes a sample's loss mask), then the all-samples process over
    every finished group. Both get slime's Samples: `remove_sample` is a slime attribute."""
    if ctx.sample_filter_hook is not None:
        fn, path = ctx.sample_filter_hook
        flat = [s for g in groups for s in g]
        given = slime_samples(flat)
        fn(ctx.args, given)
        keep_slime_changes(path, given, flat)
        for theirs, ours in zip(given, flat, strict=True):
            if getattr(theirs, "remove_sample", False) and ours.loss_mask is not None:
                ours.loss_mask = [0] * len(ours.loss_mask)
    if ctx.all_samples_hook is not None:
        fn, _ = ctx.all_samples_hook
        ordered = sorted(finished, key=lambda g: g[0].index or 0)
        fn(ctx.args, [slime_samples(g) for g in ordered], data_source)


async def _fill(
    ctx: RolloutContext,
    rollout_id: int,
    data_source: DataSource,
    params: dict[str, Any],
    target: int,
    over: int,
    kept: list[list[Sample]],
    settle: Callable[[list[Sample], int], None],
) -> None:
    """Draw groups until `target` are kept; then abort the surplus and settle it too."""
    async with asyncio.TaskGroup() as tg:
        pending: set[asyncio.Task[list[Sample]]] = set()
        while len(kept) < target:
            while len(kept) + len(pending) < target:
                for group in data_source.get_samples(over):
                    for s in group:
                        s.rollout_id = rollout_id
                    pending.add(tg.create_task(generate_group(ctx, group, params)))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            results = sorted((t.result() for t in done), key=lambda g: g[0].index or 0)
            for pos, result in enumerate(results):
                # in flight besides this group: still generating, or done and not yet settled
                settle(result, len(pending) + len(results) - pos - 1)
        if pending:
            ctx.stop.set()
            await _abort_until_done(ctx.router, pending)
            # settle in draw order, so partial groups return to the buffer oldest first
            for result in sorted((t.result() for t in pending), key=lambda g: g[0].index or 0):
                settle(result, 0)


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf of nested task-group errors: what the user needs to see (a hook's error, say)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def _abort_until_done(
    router: Router, tasks: set[asyncio.Task[list[Sample]]], interval: float = 0.5
) -> None:
    """Abort in-flight requests until every task has returned; repeats catch requests sent in between."""
    remaining = set(tasks)
    while remaining:
        await router.abort_all()
        _, remaining = await asyncio.wait(remaining, timeout=interval)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c passing samples out of n: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def passrate_metrics(groups: Sequence[Sequence[Sample]], reward_key: str | None) -> dict[str, float]:
    """slime's --log-passrate: pass@k for k = 1, 2, 4, ... up to the group size, averaged over the
    prompts; a sample passes when its reward is 1. Nothing for groups of one sample."""
    size = min((len(g) for g in groups), default=0)
    if size <= 1:
        return {}
    passed = [(len(g), sum(s.scalar_reward(reward_key) == 1 for s in g)) for g in groups]
    ks = [2**i for i in range(int(math.log2(size)) + 1)]
    return {f"passrate/pass@{k}": sum(pass_at_k(n, c, k) for n, c in passed) / len(passed) for k in ks}


def multi_turn_metrics(samples: Sequence[Sample], max_response_len: int | None) -> dict[str, float]:
    """slime's --log-multi-turn: response lengths with the observation tokens (every response token)
    and without them (the tokens the loss mask trains), their clip ratio at the response limit, and
    the round count of samples whose metadata has `round_number`."""
    if not samples:
        return {}
    raw = [float(s.response_length) for s in samples]
    own = [float(sum(s.loss_mask)) if s.loss_mask is not None else float(s.response_length) for s in samples]
    out = {
        "multi_turn/raw_response_length/response_length_mean": sum(raw) / len(raw),
        "multi_turn/raw_response_length/response_length_max": max(raw),
        "multi_turn/raw_response_length/response_length_min": min(raw),
        "multi_turn/wo_obs_response_length/response_length_mean": sum(own) / len(own),
        "multi_turn/wo_obs_response_length/response_length_max": max(own),
        "multi_turn/wo_obs_response_length/response_length_min": min(own),
    }
    if max_response_len is not None:
        clipped = sum(r >= max_response_len for r in raw) / len(raw)
        out["multi_turn/raw_response_length/response_length_clip_ratio"] = clipped
    rounds = [float(s.metadata["round_number"]) for s in samples if "round_number" in s.metadata]
    if rounds:
        out["multi_turn/multi_turn_metric/round_number_mean"] = sum(rounds) / len(rounds)
        out["multi_turn/multi_turn_metric/round_number_max"] = max(rounds)
        out["multi_turn/multi_turn_metric/round_number_min"] = min(rounds)
    return out


def reward_category_metrics(samples: Sequence[Sample], key: str) -> dict[str, float]:
    """slime's --log-reward-category: the fraction of samples per value of `key` in their dict
    rewards, as `error_cat/<value>`. A sample whose reward has no such key is refused, naming it."""
    counts: dict[str, int] = {}
    for pos, s in enumerate(samples):
        if not isinstance(s.reward, dict) or key not in s.reward:
            raise ValueError(
                f"--log-reward-category={key}: sample {pos} (index {s.index}) has reward {s.reward!r}, "
                f"not a dict with key {key!r}"
            )
        value = str(s.reward[key])
        counts[value] = counts.get(value, 0) + 1
    return {f"error_cat/{value}": n / len(samples) for value, n in counts.items()} if samples else {}


def rollout_metrics(
    groups: Sequence[Sequence[Sample]],
    reward_key: str | None,
    seconds: float,
    *,
    log_passrate: bool = False,
) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    if not samples:
        return {"rollout/seconds": seconds}
    # A dict reward without --reward-key is made scalar by --custom-reward-post-process-path on the
    # trainer's side (slime's on-policy distillation: the teacher server's answer): no mean here.
    unkeyed = reward_key is None and any(isinstance(s.reward, dict) for s in samples)
    rewards = [] if unkeyed else [s.scalar_reward(reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    passrate = passrate_metrics(groups, reward_key) if log_passrate else {}
    return {
        **passrate,
        "rollout/seconds": seconds,
        "rollout/samples": float(len(samples)),
        **({"rollout/reward_mean": sum(rewards) / len(rewards)} if rewards else {}),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/samples_per_second": len(samples) / seconds if seconds > 0 else 0.0,
    }

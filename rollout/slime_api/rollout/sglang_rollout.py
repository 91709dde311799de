"""`slime.rollout.sglang_rollout`: slime's generation functions, running on tether's rollout.

The functions keep slime's names, signatures and meaning, and take and return slime Samples:

    generate(args, sample, sampling_params)                  one generation on an engine
    generate_and_rm(args, sample, sampling_params, evaluation=False)
                                        generate (or --custom-generate-function-path), then reward
    generate_and_rm_group(args, group, sampling_params, evaluation=False)
                                        a group concurrently; the group reward with --group-rm
    generate_rollout(args, rollout_id, data_source, evaluation=False)
                                        slime's default rollout function: tether's rollout
                                        (or evaluation), as RolloutFnTrainOutput/RolloutFnEvalOutput
    generate_rollout_async / abort / eval_rollout            the pieces slime builds it from
    GenerateState(args)                                      tokenizer, sampling params, semaphore

What differs underneath: requests go through tether's Router (the engine key added there, never
seen by hooks), `GenerateState` is one per rollout context instead of one per process, and a
sample cut off by an engine fault under --use-fault-tolerance comes back aborted, as in tether's
own generate. They need a rollout context, which tether installs around every hook call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tether.rollout.engine_api.client import EngineUnavailable
from tether.rollout.evaluation import dataset_record, eval_datasets, eval_source, generate_dataset
from tether.rollout.hooks.calls import maybe_await
from tether.rollout.rollout_fn import (
    ENGINE_FAILURE,
    RolloutContext,
    current_context,
    rollout_routing,
    run_rollout,
    sampling_params,
    take_routed_experts,
)
from tether.rollout.routing.router import NoEngineError
from tether.rollout.sample import RoutedExperts
from tether.rollout.sample import Sample as TetherSample
from tether.rollout.slime_api.bridge import SlimeDataSource
from tether.rollout.slime_api.convert import to_slime
from tether.rollout.slime_api.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from tether.rollout.slime_api.rollout.filter_hub.base_types import (
    MetricGatherer,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from tether.rollout.slime_api.rollout.rm_hub import async_rm, batched_async_rm
from tether.rollout.slime_api.utils.async_utils import run
from tether.rollout.slime_api.utils.http_utils import get_rollout_num_engines
from tether.rollout.slime_api.utils.misc import _load_for_flag
from tether.rollout.slime_api.utils.types import Sample

__all__ = ["generate_rollout", "get_model_url"]

log = logging.getLogger(__name__)
_STATE = "slime_api.generate_state"
_ABORT_INTERVAL = 0.5


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The URL of `endpoint` behind the router (tether serves one model: every name gets the router)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


class GenerateState:
    """The generation state slime keeps per process; on tether one per rollout context.

    `GenerateState(args)` returns the context's instance (made on first use). It holds the
    tokenizer (the run's), the default sampling parameters (--rollout-* flags), a semaphore of
    --sglang-server-concurrency per engine, and the tasks `submit_generate_tasks` started, which
    the context cancels when it closes. `aborted` is the rollout's stop flag.
    """

    _ctx: RolloutContext

    def __new__(cls, args: Any = None) -> GenerateState:
        ctx = current_context()
        state = ctx.extensions.get(_STATE)
        if state is None:
            state = super().__new__(cls)
            state._setup(ctx, args)
            ctx.extensions[_STATE] = state
            ctx.resources.push_async_callback(state._close)
        return state  # type: ignore[no-any-return]

    def __init__(self, args: Any = None) -> None:
        """Set up once, by `__new__`."""

    def _setup(self, ctx: RolloutContext, args: Any) -> None:
        self._ctx = ctx
        self.args = args if args is not None else ctx.args
        self._tokenizer: Any = ctx.tokenizer
        self.processor: Any = None
        concurrency = ctx.rollout.sglang_server_concurrency * max(1, get_rollout_num_engines(self.args))
        self.semaphore = asyncio.Semaphore(concurrency)
        self.sampling_params: dict[str, Any] = sampling_params(ctx.rollout)
        self.dp_counts = [0]
        self.dp_rank = 0
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task[Any]] = set()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tether.rollout.data.source import load_tokenizer

            path = self._ctx.rollout.hf_checkpoint
            if path is None:
                raise RuntimeError("GenerateState.tokenizer needs --hf-checkpoint")
            self._tokenizer = load_tokenizer(path)
        return self._tokenizer

    @property
    def aborted(self) -> bool:
        return self._ctx.stop.is_set()

    @aborted.setter
    def aborted(self, value: bool) -> None:
        if value:
            self._ctx.stop.set()
        else:
            self._ctx.stop.clear()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """tether balances engines in its router; there is one data-parallel rank to choose."""
        self.dp_counts[0] += 1
        try:
            yield 0
        finally:
            self.dp_counts[0] -= 1

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """Start generating each group (`generate_and_rm_group`); the tasks join `pendings`."""
        loop = asyncio.get_running_loop()
        for group in samples:
            coro = generate_and_rm_group(self.args, group, self.sampling_params.copy(), evaluation=False)
            self.pendings.add(loop.create_task(coro))
        self.remaining_batch_size += len(samples)

    async def _close(self) -> None:
        pending = [t for t in self.pendings if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)


def _prompt_ids(state: GenerateState, sample: Sample) -> list[int]:
    if sample.tokens:
        return list(sample.tokens)
    prompt = sample.prompt
    if isinstance(prompt, list):
        text = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(state.tokenizer.encode(str(text), add_special_tokens=False))
    return list(state.tokenizer.encode(prompt, add_special_tokens=False))


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Continue `sample` on an engine by one generation; its status follows the finish reason.

    As in slime, `sampling_params["max_new_tokens"]` is reduced by the response already there (a
    partial rollout continuing), and a sample with no budget left comes back truncated.
    """
    ctx = current_context()
    state = GenerateState(args)
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(
            f"generate: sample {sample.index} has status {sample.status.value}; only pending or aborted samples generate"
        )
    if sample.multimodal_inputs and any(v is not None for v in sample.multimodal_inputs.values()):
        raise ValueError(
            f"generate: sample {sample.index} has multimodal_inputs; tether generates from text only"
        )
    budget = sampling_params.get("max_new_tokens")
    if budget is not None:
        budget = int(budget) - sample.response_length
        if budget < 0:
            raise ValueError(
                f"generate: max_new_tokens is {budget + sample.response_length}, below the response length {sample.response_length}"
            )
        sampling_params["max_new_tokens"] = budget
        if budget == 0:
            sample.status = Sample.Status.TRUNCATED
            return sample
    if not sample.tokens:
        sample.tokens = _prompt_ids(state, sample)
    if ctx.stop.is_set():
        sample.status = Sample.Status.ABORTED
        return sample
    routing = rollout_routing(ctx)  # --use-rollout-routing-replay: slime's payload["return_routed_experts"]
    try:
        _, resp = await ctx.router.generate(
            sample.tokens,
            sampling_params,
            routing_key=sample.session_id,
            return_routed_experts=routing is not None,
        )
    except (EngineUnavailable, NoEngineError) as exc:
        if not ctx.fault_tolerant:
            raise
        sample.status = Sample.Status.ABORTED
        sample.metadata[ENGINE_FAILURE] = str(exc)
        if isinstance(exc, NoEngineError):
            await ctx.router.wait_for_engine()
        return sample
    log_probs = resp.log_probs()
    meta = {
        "id": resp.meta_info.id,
        "finish_reason": {"type": resp.finish_type},
        "prompt_tokens": resp.meta_info.prompt_tokens,
        "completion_tokens": resp.meta_info.completion_tokens,
        "output_token_logprobs": [[lp, tok] for lp, tok in zip(log_probs, resp.output_ids, strict=True)],
        "weight_version": resp.weight_version,
    }
    sample.append_response_tokens(
        args, tokens=resp.output_ids, log_probs=log_probs, trainable=True, meta_info=meta, text=resp.text
    )
    if routing is not None:
        # slime keeps them on the Sample as an int32 [len(tokens)-1, layers, topk] array; the rows
        # before routed_experts_start_len stay from the previous turn.
        held = sample.rollout_routed_experts
        turn = TetherSample(
            index=sample.index,
            tokens=list(sample.tokens),
            rollout_routed_experts=None if held is None else RoutedExperts.from_array(np.asarray(held)),
        )
        take_routed_experts(turn, resp, routing, required=resp.finish_type != "abort")
        if turn.rollout_routed_experts is not None:
            sample.rollout_routed_experts = turn.rollout_routed_experts.array().copy()
    return sample


def _takes_evaluation(fn: Callable[..., Any]) -> bool:
    try:
        return "evaluation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """Generate one sample (the sample's or --custom-generate-function-path's function, else
    `generate`) and reward it, unless --group-rm leaves that to the group."""
    if (
        getattr(args, "partial_rollout", False)
        and getattr(args, "mask_offpolicy_in_partial_rollout", False)
        and sample.response_length > 0
    ):
        sample.loss_mask = [0] * sample.response_length  # earlier segments came from older weights
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        path = sample.generate_function_path or getattr(args, "custom_generate_function_path", None)
        result: Sample | list[Sample]
        if path:
            fn = _load_for_flag(path, "--custom-generate-function-path")
            kwargs = {"evaluation": evaluation} if _takes_evaluation(fn) else {}
            result = await maybe_await(fn(args, sample, sampling_params, **kwargs))
        else:
            result = await generate(args, sample, sampling_params)
    if getattr(args, "group_rm", False):
        return result
    if isinstance(result, list):
        if any(s.status == Sample.Status.ABORTED for s in result):
            return result
        unscored = [s for s in result if s.reward is None]
        for s, reward in zip(unscored, await batched_async_rm(args, unscored), strict=True):
            s.reward = reward
        return result
    if result.status != Sample.Status.ABORTED and result.reward is None:
        result.reward = await async_rm(args, result)
    return result


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """Every sample of a group at once (each with a session id, so its turns stay on one engine),
    then the group's rewards with --group-rm. An element is a list when a custom generate fans out."""
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(generate_and_rm(args, s, dict(sampling_params), evaluation=evaluation))
            for s in group
        ]
    out: list[Any] = [t.result() for t in tasks]
    if not state.aborted and getattr(args, "group_rm", False):
        for s, reward in zip(out, await batched_async_rm(args, out), strict=True):
            s.reward = reward
    return out


async def abort(args: Any, rollout_id: int) -> list[list[Sample]]:
    """Abort what `submit_generate_tasks` left in flight and wait for it; with --partial-rollout,
    return the unfinished groups (to go back to the data source)."""
    ctx = current_context()
    state = GenerateState(args)
    state.aborted = True
    kept: list[list[Sample]] = []
    while state.pendings:
        await ctx.router.abort_all()
        done, state.pendings = await asyncio.wait(state.pendings, timeout=_ABORT_INTERVAL)
        for task in done:
            group = task.result()
            if not getattr(args, "partial_rollout", False):
                continue
            for sample in group:
                if isinstance(sample, Sample) and sample.response:
                    sample.metadata.setdefault("start_rollout_id", rollout_id)
            kept.append(group)
    return kept


async def generate_rollout_async(
    args: Any, rollout_id: int, data_source: Callable[[int], list[list[Sample]]]
) -> tuple[RolloutFnTrainOutput, list[list[Sample]]]:
    """slime's rollout loop: draw --over-sampling-batch-size groups while fewer than
    --rollout-batch-size are done or in flight, keep the groups the dynamic filter keeps, then abort
    the rest. Returns the kept groups (by sample index) and the aborted ones."""
    state = GenerateState(args)
    path = getattr(args, "dynamic_sampling_filter_path", None)
    dynamic_filter = _load_for_flag(path, "--dynamic-sampling-filter-path") if path else None
    gatherer = MetricGatherer()
    target = int(args.rollout_batch_size)
    draw = int(getattr(args, "over_sampling_batch_size", None) or target)
    data: list[list[Any]] = []
    while len(data) < target:
        while state.remaining_batch_size < target:
            state.submit_generate_tasks(data_source(draw))
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            verdict = call_dynamic_filter(dynamic_filter, args, group)
            if should_drop_dynamic_filter_output(
                verdict, remaining_batch_size=state.remaining_batch_size, target_data_size=target
            ):
                gatherer.on_dynamic_filter_drop(verdict.reason)
                state.remaining_batch_size -= 1
                continue
            if len(data) < target:
                data.append(group)
    aborted = await abort(args, rollout_id)
    data.sort(key=_first_index)
    state.reset()
    return RolloutFnTrainOutput(samples=data, metrics=dict(gatherer.collect())), aborted


def _first_index(group: list[Any]) -> int:
    first = group[0]
    while isinstance(first, list):
        first = first[0]
    return first.index if first.index is not None else -1


async def eval_rollout(args: Any, rollout_id: int) -> tuple[RolloutFnEvalOutput, list[list[Sample]]]:
    """Every evaluation dataset generated and scored (tether's evaluation generation), in slime's
    shape: per dataset name its rewards, truncation flags and samples."""
    ctx = current_context()
    if getattr(args, "group_rm", False):
        raise ValueError("eval_rollout: --group-rm is not supported for evaluation (as in slime)")
    data: dict[str, dict[str, Any]] = {}
    for dataset in eval_datasets(ctx):
        source = await asyncio.to_thread(eval_source, ctx, dataset)
        groups = await generate_dataset(ctx, dataset, source, rollout_id)
        samples = sorted((s for g in groups for s in g if s.reward is not None), key=lambda s: s.index or 0)
        data[dataset.name] = dataset_record(samples, dataset.reward_key)
    return RolloutFnEvalOutput(data=data), []


async def _tether_rollout(args: Any, rollout_id: int, data_source: Any) -> RolloutFnTrainOutput:
    ctx = current_context()
    if not isinstance(data_source, SlimeDataSource):
        raise TypeError(
            f"generate_rollout: data_source is a {type(data_source).__name__}; on tether it must be the data "
            "source tether passes to the rollout function"
        )
    groups = await run_rollout(ctx, rollout_id, data_source.tether)
    return RolloutFnTrainOutput(
        samples=[[to_slime(s) for s in group] for group in groups], metrics=dict(ctx.metrics)
    )


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's default rollout function, run by tether's rollout (over-sampling, dynamic filter,
    partial rollout, fault tolerance as configured) or evaluation. Synchronous, as in slime: call it
    from a thread (tether does), not on the rollout's event loop."""
    if evaluation:
        output, _ = run(eval_rollout(args, rollout_id))
        return output
    return run(_tether_rollout(args, rollout_id, data_source))

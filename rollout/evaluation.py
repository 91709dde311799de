"""Evaluation on held-out prompts (--eval-config or --eval-prompt-data, every --eval-interval
rollouts), with the rollout's rewards.

Every prompt of each dataset is generated its dataset's `n_samples_per_eval_prompt` times with its
sampling settings (`tether.rollout.data.eval_config` resolves them as slime does), scored by the
dataset's reward (its `rm_type` or `custom_rm_path`, else the rollout's), and summarised into
metrics named `eval/<dataset>/...`. No dynamic filter and no aborts: evaluation sees every prompt
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tether.rollout.data.eval_config import EvalDataset, resolve_eval_datasets
from tether.rollout.data.source import DataSource, load_prompts, load_tokenizer
from tether.rollout.hooks.calls import load_function, slime_samples
from tether.rollout.rewards.scoring import RewardModel
from tether.rollout.rollout_fn import RolloutContext, generate_group, group_aborted
from tether.rollout.sample import Sample, SampleStatus


def should_evaluate(eval_interval: int | None, rollout_id: int, *, has_data: bool) -> bool:
    """slime's schedule: evaluate after every `eval_interval`-th rollout."""
    return has_data and eval_interval is not None and (rollout_id + 1) % eval_interval == 0


def eval_datasets(ctx: RolloutContext) -> list[EvalDataset]:
    return resolve_eval_datasets(ctx.data, ctx.rollout)


def eval_source(ctx: RolloutContext, dataset: EvalDataset) -> DataSource:
    """The dataset's prompts (read and tokenized: call off the event loop), its metadata applied."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        if ctx.rollout.hf_checkpoint is None:
            raise ValueError("evaluation needs --hf-checkpoint for the tokenizer")
        tokenizer = load_tokenizer(ctx.rollout.hf_checkpoint)
    prompts, dropped = load_prompts(
        dataset.path,
        tokenizer,
        input_key=dataset.input_key,
        label_key=dataset.label_key,
        metadata_key=dataset.metadata_key,
        apply_chat_template=dataset.apply_chat_template,
        max_prompt_len=dataset.max_prompt_len,
        tool_key=dataset.tool_key,
        apply_chat_template_kwargs=dataset.apply_chat_template_kwargs,
    )
    extra = dataset.sample_metadata()
    if extra:
        for record in prompts:
            record.metadata = {**record.metadata, **extra}
    return DataSource(
        prompts, n_samples_per_prompt=dataset.n_samples_per_eval_prompt, dropped_long_prompts=dropped
    )


def eval_sampling_params(dataset: EvalDataset) -> dict[str, Any]:
    """SGLang sampling_params of one evaluation dataset."""
    params: dict[str, Any] = {
        "temperature": dataset.temperature,
        "top_p": dataset.top_p,
        "top_k": dataset.top_k,
        "skip_special_tokens": dataset.skip_special_tokens,
        # the matched stop token stays in the tokens, as in the rollout, unless the dataset says otherwise
        "no_stop_trim": True if dataset.no_stop_trim is None else dataset.no_stop_trim,
        "spaces_between_special_tokens": False,
    }
    optional = {
        "max_new_tokens": dataset.max_response_len,
        "min_new_tokens": dataset.min_new_tokens,
        "repetition_penalty": dataset.repetition_penalty,
        "stop": list(dataset.stop) or None,
        "stop_token_ids": list(dataset.stop_token_ids) or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


async def generate_dataset(
    ctx: RolloutContext, dataset: EvalDataset, source: DataSource, rollout_id: int
) -> list[list[Sample]]:
    """Every prompt of `source` generated and scored with the dataset's settings."""
    params = eval_sampling_params(dataset)
    groups = source.get_samples(len(source))
    for group in groups:
        for s in group:
            s.rollout_id = rollout_id
    hook: tuple[Callable[..., Any], str] | None = ctx.generate_hook
    if dataset.custom_generate_function_path is not None:
        path = dataset.custom_generate_function_path
        hook = (load_function(path, "--eval-config custom_generate_function_path"), path)
    async with contextlib.AsyncExitStack() as stack:
        reward: RewardModel | None = None
        if dataset.custom_rm_path != ctx.rollout.custom_rm_path:
            own = msgspec.structs.replace(ctx.rollout, custom_rm_path=dataset.custom_rm_path)
            reward = await stack.enter_async_context(RewardModel(own, ctx.args))
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(
                    generate_group(
                        ctx,
                        g,
                        params,
                        evaluation=True,
                        generate_hook=hook,
                        reward_model=reward,
                        max_context_len=dataset.max_context_len,
                    )
                )
                for g in groups
            ]
    return [t.result() for t in tasks]


def dataset_record(samples: list[Sample], reward_key: str | None) -> dict[str, Any]:
    """slime's per-dataset evaluation data: rewards, truncation flags and (slime's) samples."""
    return {
        "rewards": [s.scalar_reward(reward_key) for s in samples],
        "truncated": [s.status == SampleStatus.TRUNCATED for s in samples],
        "samples": slime_samples(samples),
    }


async def evaluate_dataset(
    ctx: RolloutContext,
    dataset: EvalDataset,
    source: DataSource,
    rollout_id: int,
    data_out: dict[str, Any] | None = None,
) -> dict[str, float]:
    """`eval/<name>/...` figures of one dataset; `data_out` (when given) receives slime's per-dataset
    record `{name: {rewards, truncated, samples}}` for --custom-eval-rollout-log-function-path."""
    started = time.monotonic()
    results = await generate_dataset(ctx, dataset, source, rollout_id)
    samples = [s for g in results if not group_aborted(g) for s in g if s.status != SampleStatus.FAILED]
    prefix = f"eval/{dataset.name}/"
    if data_out is not None:
        data_out[dataset.name] = dataset_record(samples, dataset.reward_key)
    if not samples:
        return {prefix + "samples": 0.0}
    rewards = [s.scalar_reward(dataset.reward_key) for s in samples]
    return {
        prefix + "samples": float(len(samples)),
        prefix + "reward_mean": sum(rewards) / len(rewards),
        prefix + "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        prefix + "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        prefix + "aborted_groups": float(sum(group_aborted(g) for g in results)),
        prefix + "dropped_long_prompts": float(source.dropped_long_prompts),
        prefix + "seconds": time.monotonic() - started,
    }


async def run_evaluation(
    ctx: RolloutContext, rollout_id: int, data_out: dict[str, Any] | None = None
) -> dict[str, float]:
    """Metrics over every evaluation dataset (`data_out`: see `evaluate_dataset`)."""
    metrics: dict[str, float] = {}
    for dataset in eval_datasets(ctx):
        source = await asyncio.to_thread(eval_source, ctx, dataset)  # reads and tokenizes: off the loop
        metrics.update(await evaluate_dataset(ctx, dataset, source, rollout_id, data_out))
    return metrics

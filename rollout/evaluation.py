"""Evaluation on held-out prompts (--eval-prompt-data, every --eval-interval rollouts), with the rollout's rewards.

Every prompt of each dataset is generated --n-samples-per-eval-prompt times with the eval sampling
overrides, scored by the same reward functions, and summarised into metrics named
`eval/<dataset>/...`. No dynamic filter and no aborts: evaluation sees every prompt once.
"""

from __future__ import annotations

import asyncio
import time

from tether.rollout.data_source import DataSource, load_prompts, load_tokenizer
from tether.rollout.rollout_fn import RolloutContext, generate_group, group_aborted, sampling_params
from tether.rollout.sample import Sample, SampleStatus


def should_evaluate(eval_interval: int | None, rollout_id: int, *, has_data: bool) -> bool:
    """slime's schedule: evaluate after every `eval_interval`-th rollout."""
    return has_data and eval_interval is not None and (rollout_id + 1) % eval_interval == 0


def eval_source(ctx: RolloutContext, path: str) -> DataSource:
    data, cfg = ctx.data, ctx.rollout
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        if cfg.hf_checkpoint is None:
            raise ValueError("evaluation needs --hf-checkpoint for the tokenizer")
        tokenizer = load_tokenizer(cfg.hf_checkpoint)
    prompts, dropped = load_prompts(
        path,
        tokenizer,
        input_key=data.eval_input_key or data.input_key,
        label_key=data.eval_label_key or data.label_key,
        metadata_key=data.metadata_key,
        apply_chat_template=data.apply_chat_template,
        max_prompt_len=cfg.rollout_max_prompt_len,
        tool_key=data.tool_key,
        apply_chat_template_kwargs=data.apply_chat_template_kwargs,
    )
    return DataSource(
        prompts, n_samples_per_prompt=data.n_samples_per_eval_prompt, dropped_long_prompts=dropped
    )


async def evaluate_dataset(
    ctx: RolloutContext, name: str, source: DataSource, rollout_id: int
) -> dict[str, float]:
    params = sampling_params(ctx.rollout, evaluation=ctx.data)
    groups = source.get_samples(len(source))
    for group in groups:
        for s in group:
            s.rollout_id = rollout_id
    started = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(generate_group(ctx, g, params, evaluation=True)) for g in groups]
    results: list[list[Sample]] = [t.result() for t in tasks]
    samples = [s for g in results if not group_aborted(g) for s in g if s.status != SampleStatus.FAILED]
    prefix = f"eval/{name}/"
    if not samples:
        return {prefix + "samples": 0.0}
    rewards = [s.scalar_reward(ctx.rollout.reward_key) for s in samples]
    return {
        prefix + "samples": float(len(samples)),
        prefix + "reward_mean": sum(rewards) / len(rewards),
        prefix + "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        prefix + "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        prefix + "aborted_groups": float(sum(group_aborted(g) for g in results)),
        prefix + "dropped_long_prompts": float(source.dropped_long_prompts),
        prefix + "seconds": time.monotonic() - started,
    }


async def run_evaluation(ctx: RolloutContext, rollout_id: int) -> dict[str, float]:
    """Metrics over every dataset of --eval-prompt-data."""
    metrics: dict[str, float] = {}
    for name, path in ctx.data.eval_datasets():
        source = await asyncio.to_thread(eval_source, ctx, path)  # reads and tokenizes: off the loop
        metrics.update(await evaluate_dataset(ctx, name, source, rollout_id))
    return metrics

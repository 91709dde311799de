"""Calling rollout functions written against slime's API (--rollout-function-path), and what they return.

slime calls `generate_rollout(args, rollout_id, data_source, evaluation=False)`, usually a plain
function that runs its coroutines with `slime.utils.async_utils.run`. tether calls a plain one in
a worker thread (its coroutines then run on the rollout's loop) and awaits an async one, giving it
tether's data source wrapped to hand out and take back slime Samples (`SlimeDataSource`).

Both return shapes are accepted: `RolloutFnTrainOutput(samples, metrics)` (newer slime) or the
bare groups (older), where a group is a list of Samples, possibly nested (a generate hook that
fans out into several samples), or the samples come flat and are grouped by `group_index`. For
evaluation, `RolloutFnEvalOutput(data, metrics)` or the bare `data` dict, whose per-dataset
`rewards` and `truncated` lists become tether's `eval/<name>/...` metrics. Every sample is
converted to tether's Sample and checked against the contract; a failure names the rollout
function, the sample and the field.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from tether.rollout.data.source import DataSource as TetherDataSource
from tether.rollout.hooks.calls import HookError, maybe_await
from tether.rollout.rollout_fn import RolloutContext, rollout_metrics
from tether.rollout.sample import Sample, SampleContractError, validate_group, validate_sample
from tether.rollout.slime_api.convert import (
    ConversionError,
    from_slime,
    is_slime_sample,
    reward_value,
    to_slime,
)
from tether.rollout.slime_api.rollout.data_source import DataSource


class SlimeDataSource(DataSource):
    """tether's data source as a slime rollout function sees it: groups of slime Samples."""

    def __init__(self, data: TetherDataSource, path: str = "--rollout-function-path") -> None:
        self.tether = data
        self._path = path
        self.metadata: dict[str, Any] = {}
        """slime's free-form data-source metadata (`update_metadata` / `get_metadata`)."""

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        return [[to_slime(s) for s in group] for group in self.tether.get_samples(num_samples)]

    def add_samples(self, samples: list[list[Any]]) -> None:
        groups = []
        for g, group in enumerate(samples):
            if not isinstance(group, list):
                raise HookError(self._path, f"add_samples: group {g} is a {type(group).__name__}, not a list")
            groups.append(
                [_convert(self._path, s, f"add_samples: group {g} sample {i}: ") for i, s in enumerate(group)]
            )
        self.tether.add_samples(groups)

    def save(self, rollout_id: int) -> None:
        """Nothing to do: tether saves the data position with every checkpoint."""

    def load(self, rollout_id: int | None = None) -> None:
        """Nothing to do: tether restores the data position when it resumes."""

    def __len__(self) -> int:
        return len(self.tether)

    def get_buffer_length(self) -> int:
        return self.tether.buffer_size

    def update_metadata(self, metadata: Mapping[str, Any]) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata


def _convert(path: str, item: Any, where: str) -> Sample:
    try:
        return from_slime(item)
    except ConversionError as exc:
        raise HookError(path, where + str(exc), field=exc.field) from exc


async def call_rollout_function(
    fn: Callable[..., Any],
    ctx: RolloutContext,
    rollout_id: int,
    data: TetherDataSource | None,
    *,
    path: str,
    evaluation: bool = False,
) -> Any:
    """`fn(args, rollout_id, data_source, evaluation=...)`, as slime calls it (see the module docstring)."""
    source = SlimeDataSource(data, path) if data is not None else None
    if inspect.iscoroutinefunction(fn):
        return await fn(ctx.args, rollout_id, source, evaluation=evaluation)
    # A plain function may block (slime's run() waits for coroutines it hands to this loop).
    result = await asyncio.to_thread(fn, ctx.args, rollout_id, source, evaluation=evaluation)
    return await maybe_await(result)


async def slime_rollout(
    fn: Callable[..., Any], ctx: RolloutContext, rollout_id: int, data: TetherDataSource, *, path: str
) -> tuple[list[list[Sample]], dict[str, float]]:
    """One training rollout by a slime-API rollout function: tether's checked groups and its metrics."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    output = await call_rollout_function(fn, ctx, rollout_id, data, path=path)
    if hasattr(output, "data") and not hasattr(output, "samples"):
        raise HookError(path, "returned an evaluation output (RolloutFnEvalOutput) for a training rollout")
    samples = output.samples if hasattr(output, "samples") else output
    extra = (getattr(output, "metrics", None) or {}) if hasattr(output, "samples") else {}
    groups = groups_from_slime(path, samples, rollout_id)
    metrics = rollout_metrics(
        groups, ctx.rollout.reward_key, loop.time() - started, log_passrate=ctx.rollout.log_passrate
    )
    metrics.update(_numeric(path, extra))
    return groups, metrics


def groups_from_slime(path: str, samples: object, rollout_id: int) -> list[list[Sample]]:
    """tether's groups for what a rollout function returned, each sample converted and checked."""
    if not isinstance(samples, list) or not samples:
        raise HookError(path, f"returned {_describe(samples)}; expected a non-empty list of sample groups")
    if all(_is_sample(item) for item in samples):
        by_group: dict[int, list[Any]] = {}
        for pos, item in enumerate(samples):
            key = getattr(item, "group_index", None)
            if key is None:
                raise HookError(
                    path,
                    f"returned a flat list of samples, and sample {pos} has no group_index to group it by",
                    field="group_index",
                )
            by_group.setdefault(key, []).append(item)
        raw_groups = list(by_group.values())
    else:
        raw_groups = []
        for g, group in enumerate(samples):
            if not isinstance(group, list):
                raise HookError(path, f"group {g} is {_describe(group)}; expected a list of samples")
            raw_groups.append(_flatten(path, group, g))
    groups: list[list[Sample]] = []
    for g, raw in enumerate(raw_groups):
        group = [_convert(path, item, f"group {g} sample {i}: ") for i, item in enumerate(raw)]
        for sample in group:
            if sample.rollout_id is None:
                sample.rollout_id = rollout_id
        try:
            validate_group(group, len(group))
            for sample in group:
                validate_sample(sample)
        except SampleContractError as exc:
            raise HookError(path, f"group {g}: {exc}", field=exc.field) from exc
        groups.append(group)
    return groups


def _flatten(path: str, group: list[Any], g: int) -> list[Any]:
    out: list[Any] = []
    for item in group:
        if isinstance(item, list):
            out.extend(_flatten(path, item, g))
        elif _is_sample(item):
            out.append(item)
        else:
            raise HookError(path, f"group {g} holds {_describe(item)}; expected Samples")
    if not out:
        raise HookError(path, f"group {g} is empty")
    return out


def _is_sample(item: object) -> bool:
    return isinstance(item, Sample) or is_slime_sample(item)


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"


def _numeric(path: str, metrics: object) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise HookError(path, f"returned metrics {_describe(metrics)}; expected a dict of numbers")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        number = reward_value(value)
        if isinstance(number, float) and math.isfinite(number):
            out[str(key)] = number
    return out


async def slime_evaluation(
    fn: Callable[..., Any],
    ctx: RolloutContext,
    rollout_id: int,
    data: TetherDataSource | None,
    *,
    path: str,
    data_out: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Evaluation by a slime-API rollout function (called with evaluation=True), as tether's metrics;
    `data_out` (when given) receives the per-dataset data it returned."""
    output = await call_rollout_function(fn, ctx, rollout_id, data, path=path, evaluation=True)
    metrics = eval_metrics(path, output)
    if data_out is not None:
        data_out.update(eval_data(output))
    return metrics


def eval_data(output: object) -> Mapping[str, Any]:
    """The data by dataset name inside what an evaluation returned (a shape `eval_metrics` accepted)."""
    found = output[0] if isinstance(output, tuple) else output
    data = getattr(found, "data", found)
    return data if isinstance(data, Mapping) else {}


def eval_metrics(path: str, output: object) -> dict[str, float]:
    """tether's `eval/<name>/...` metrics from what an evaluation returned: RolloutFnEvalOutput, the
    bare dict by dataset name, or slime's `eval_rollout` pair `(output, [])`."""
    if isinstance(output, tuple) and len(output) == 2:
        output = output[0]
    if hasattr(output, "samples") and not hasattr(output, "data"):
        raise HookError(path, "returned a training output (RolloutFnTrainOutput) for an evaluation")
    data_by_name = getattr(output, "data", output)
    if not isinstance(data_by_name, Mapping):
        raise HookError(
            path, f"evaluation returned {_describe(data_by_name)}; expected a dict by dataset name"
        )
    metrics: dict[str, float] = {}
    for name, result in data_by_name.items():
        rewards = result.get("rewards") if isinstance(result, Mapping) else None
        if not isinstance(rewards, list):
            raise HookError(path, f"evaluation dataset {name!r} has no list of 'rewards'", field="rewards")
        values = [reward_value(r) for r in rewards]
        if not all(isinstance(v, float) for v in values):
            raise HookError(
                path,
                f"evaluation dataset {name!r}: rewards must be numbers, got {rewards[:5]!r}",
                field="rewards",
            )
        prefix = f"eval/{name}/"
        metrics[prefix + "samples"] = float(len(values))
        if values:
            metrics[prefix + "reward_mean"] = sum(values) / len(values)
        truncated = result.get("truncated")
        if isinstance(truncated, list) and truncated:
            metrics[prefix + "truncated_ratio"] = sum(bool(t) for t in truncated) / len(truncated)
    metrics.update(_numeric(path, getattr(output, "metrics", None) or {}))
    return metrics

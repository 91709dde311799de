"""`slime.rollout.base_types`: what a rollout function returns.

slime's rollout functions return `RolloutFnTrainOutput(samples, metrics)` for training and
`RolloutFnEvalOutput(data, metrics)` for evaluation; older ones return the bare groups (or the
bare eval dict). tether accepts both shapes (`tether.rollout.slime_api.bridge`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RolloutFnTrainOutput:
    samples: list[Any]
    """Groups of slime Samples (`list[list[Sample]]`); a group may itself hold lists (fan-out)."""
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    """Per eval dataset name: `{"rewards": [...], "truncated": [...], "samples": [...]}`."""
    metrics: dict[str, Any] | None = None


def call_rollout_fn(
    fn: Callable[..., Any], *args: Any, evaluation: bool, **kwargs: Any
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function and wrap an old-style return in the new types."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, RolloutFnTrainOutput | RolloutFnEvalOutput):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)

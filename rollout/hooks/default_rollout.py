"""The default --rollout-function-path: slime's signature over tether's rollout and evaluation."""

from __future__ import annotations

from typing import Any

from tether.rollout.data.source import DataSource
from tether.rollout.evaluation import run_evaluation
from tether.rollout.rollout_fn import current_context, run_rollout
from tether.rollout.sample import Sample


async def generate_rollout(
    args: Any, rollout_id: int, data_source: DataSource, evaluation: bool = False
) -> list[list[Sample]] | dict[str, float]:
    """slime's rollout-function signature; needs a RolloutContext installed by the caller
    (`using_context`).

    Returns the rollout's groups, or with `evaluation=True` the evaluation metrics.
    """
    ctx = current_context()
    if evaluation:
        return await run_evaluation(ctx, rollout_id)
    return await run_rollout(ctx, rollout_id, data_source)

"""`slime.rollout.filter_hub.dynamic_sampling_filters`: the over-sampling filters slime ships."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tether.rollout.slime_api.rollout.filter_hub.base_types import DynamicFilterOutput

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]

MIN_STD = 1e-6


def _std(values: Sequence[float]) -> float:
    """The sample standard deviation; NaN for fewer than two values (so one sample never passes)."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def check_reward_nonzero_std(args: Any, samples: Sequence[Any], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (std above 1e-6): all-equal rewards give GRPO no signal."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    keep = _std(rewards) > MIN_STD
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(
    args: Any, samples: Sequence[Any], **kwargs: Any
) -> DynamicFilterOutput:
    """As check_reward_nonzero_std, but a dropped group is kept when the batch would fall short
    without it (no extra over-sampling round)."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output

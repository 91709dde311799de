"""`slime.rollout.rm_hub.deepscaler`: DeepScaleR's reward, the boxed answer after the reasoning.

The rule lives once, in `tether.rollout.rewards.rules`, which tether's `--rm-type deepscaler` uses.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.rewards.rules import deepscaler_score


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    """1 when the last `\\boxed{}` after `</think>` (or after `###Response`) equals the label, else 0;
    0 when the response has neither marker, no boxed answer there, or the label is ""."""
    return deepscaler_score(response, label)

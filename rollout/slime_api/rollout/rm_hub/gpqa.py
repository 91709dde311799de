"""`slime.rollout.rm_hub.gpqa`: the multiple-choice (GPQA) reward.

The rule lives once, in `tether.rollout.rewards.rules`, which tether's `--rm-type gpqa` uses.
"""

from __future__ import annotations

import string
from typing import Any

from tether.rollout.rewards.rules import gpqa_score

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])
"""The option letters when neither `valid_letters` nor `choices` is in the metadata: A to J."""


def compute_gpqa_reward(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the response picks the right option (by its letter, or by saying its text), else 0.0.

    The right option: metadata `correct_letter`, else a one-letter label, an index label, or a label
    equal to one of metadata `choices` (then also stored as metadata `correct_answer`, as slime does).
    """
    return gpqa_score(response, label, metadata)

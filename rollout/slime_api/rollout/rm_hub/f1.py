"""`slime.rollout.rm_hub.f1`: SQuAD's token F1 (`--rm-type f1` scores its first element).

The rule lives once, in `tether.rollout.rewards.rules`, which tether's `--rm-type f1` uses.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.rewards.rules import f1_parts, squad_normalize


def normalize_answer(s: str) -> str:
    """Lower case, punctuation and articles (a, an, the) removed, whitespace collapsed."""
    return squad_normalize(s)


def f1_score(prediction: str | None, ground_truth: Any) -> tuple[float, float, float]:
    """(F1, precision, recall) of the normalised tokens; (0, 0, 0) for a None prediction, no
    overlap, or a yes/no/noanswer on either side the other does not equal."""
    return f1_parts(prediction, ground_truth)

"""`slime.rollout.rm_hub.math_dapo_utils`: DAPO's math scorer (`compute_score`) by slime's rules.

Every name is slime's, with its signature and results (`compute_score` answers a dict, and its
`remove_boxed` raises AssertionError on what is not `\\boxed{...}`, unlike math_utils'). The rules live
once, in `tether.rollout.rewards.rules`, which tether's own `--rm-type dapo` scores with too.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType
from typing import Any

from tether.rollout.rewards import rules

SUBSTITUTIONS = list(rules.MINERVA_SUBSTITUTIONS)
REMOVED_EXPRESSIONS = list(rules.MINERVA_REMOVED)


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}`, braces included; None without one or when it never closes."""
    return rules.dapo_last_boxed(string)


def remove_boxed(s: str) -> str:
    """What `\\boxed{...}` encloses; AssertionError ("box error") for anything else."""
    return rules.dapo_unbox(s)


def normalize_final_answer(final_answer: str) -> str:
    """A final answer in Minerva's canonical text: after its last `=`, units, TeX wrappers and $ gone."""
    return rules.minerva_normalize(final_answer)


def is_correct_minerva(
    solution_str: str,
    gt: str,
    gt_need_extract: bool = False,
    answer_pattern: str = rules.DAPO_ANSWER_PATTERN,
) -> tuple[bool, str]:
    """(whether the last `answer_pattern` match equals the integer `gt`, the normalised match)."""
    return rules.minerva_check(solution_str, gt, gt_need_extract, answer_pattern)


def is_correct_strict_box(
    pred: str, gt: str, pause_tokens_index: list[int] | None = None
) -> tuple[int, str | None]:
    """(1 if the last `\\boxed{}` of the last 100 characters is exactly `gt`, else -1; its contents)."""
    return rules.strict_box_check(pred, gt, pause_tokens_index)


def verify(
    solution_str: str,
    answer: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict boxed check or, by default, the Minerva `Answer:` check."""
    return rules.dapo_verify(solution_str, answer, strict_box_verify, pause_tokens_index)


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": ...} for the solution's last 300 characters."""
    return rules.dapo_score(solution_str, ground_truth, strict_box_verify, pause_tokens_index)


class timeout:  # slime's name, lower case
    """`with timeout(seconds):` raises TimeoutError(error_message) when the block runs longer.

    By SIGALRM, as slime's: main thread only, whole seconds, and it replaces any SIGALRM handler."""

    def __init__(self, seconds: int = 1, error_message: str = "Timeout") -> None:
        self.seconds = seconds
        self.error_message = error_message

    def handle_timeout(self, signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(self.error_message)

    def __enter__(self) -> None:
        signal.signal(signal.SIGALRM, self.handle_timeout)
        signal.alarm(self.seconds)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        signal.alarm(0)

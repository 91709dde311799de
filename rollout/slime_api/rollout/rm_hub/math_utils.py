"""`slime.rollout.rm_hub.math_utils`: boxed-answer extraction and grading, on tether's math verifier."""

from __future__ import annotations

from typing import Any

from tether.rollout.rewards import last_boxed, math_equal


def extract_answer(passage: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `passage`; None without one."""
    if "\\boxed" not in passage and "\\fbox" not in passage:
        return None
    return last_boxed(passage)


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` itself, braces included; None without one."""
    inner = extract_answer(string)
    return None if inner is None else f"\\boxed{{{inner}}}"


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the solution's boxed answer equals the ground truth (itself boxed or plain).

    Equality is tether's `math_equal`: the same text after normalising LaTeX, or the same number.
    """
    if not ground_truth:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth) or truth
    given = extract_answer(solution_str)
    return given is not None and math_equal(given, truth)

"""`slime.rollout.rm_hub.math_utils`: boxed-answer extraction and grading by slime's rules."""

from __future__ import annotations

from typing import Any

from tether.rollout.rewards.rules import boxed_content, grade_boxed_math, grade_mathd, grade_sympy


def extract_answer(passage: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `passage`; None without one."""
    return boxed_content(passage)


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` itself, braces included; None without one."""
    inner = boxed_content(string)
    return None if inner is None else f"\\boxed{{{inner}}}"


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    """Equal after Hendrycks' MATH normalisation."""
    return grade_mathd(given_answer, ground_truth)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    """Equal as expressions (sympy), element by element for tuples and intervals."""
    return grade_sympy(given_answer, ground_truth)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the solution's last boxed answer equals the ground truth (itself boxed or plain)."""
    return grade_boxed_math(solution_str, ground_truth)

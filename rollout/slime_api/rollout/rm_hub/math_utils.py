"""`slime.rollout.rm_hub.math_utils`: boxed-answer extraction and MATH grading by slime's rules.

Every name is slime's, with its signature and results; the rules themselves live once, in
`tether.rollout.rewards.rules`, which tether's own `--rm-type math` scores with too.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.rewards import rules

BAD_SUBSTRINGS = list(rules.SYMPY_BAD_SUBSTRINGS)
BAD_REGEXES = list(rules.SYMPY_BAD_REGEXES)
TUPLE_CHARS = rules.TUPLE_BRACKETS


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed...}` as written, braces included (else the last `\\fbox...}`); None
    without one or when its braces never close."""
    return rules.last_boxed(string)


def remove_boxed(s: str | None) -> str | None:
    """What `\\boxed{...}` encloses; None for anything else (an `\\fbox{}`, None)."""
    return rules.unbox(s)


def extract_boxed_answer(solution: str) -> str | None:
    """The contents of the last `\\boxed{...}`; None without one (an `\\fbox{}` gives None too)."""
    return rules.unbox(rules.last_boxed(solution))


def extract_answer(passage: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `passage`; None when it has no `\\boxed`."""
    return rules.boxed_content(passage)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """An answer in Hendrycks' MATH canonical text (stripped as given when it cannot be rewritten)."""
    return rules.hendrycks_normalize(answer)


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    """Equal after Hendrycks' MATH normalisation."""
    return rules.grade_mathd(given_answer, ground_truth)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    """Equal as expressions (sympy), element by element for tuples and intervals."""
    return rules.grade_sympy(given_answer, ground_truth)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the solution's last boxed answer equals the ground truth (itself boxed or plain)."""
    return rules.grade_boxed_math(solution_str, ground_truth)


def count_unknown_letters_in_expr(expr: str) -> int:
    """Distinct letters in `expr` other than those of `sqrt` and `frac`."""
    return rules.unknown_letters(expr)


def should_allow_eval(expr: str) -> bool:
    """Whether sympy may be given `expr` (at most two unknowns, no towers of powers)."""
    return rules.may_evaluate(expr)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    """Whether the difference of the two normalised answers simplifies to 0."""
    return rules.sympy_equal(ground_truth_normalized, given_normalized)


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval (after dropping thousands separators), else `[expr]`."""
    return rules.tuple_items(expr)

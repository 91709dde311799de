"""The demo task's verifier: exact answers score 1, permutations get partial credit, the rest 0."""

from __future__ import annotations

import pytest

from tether.commands import demo_task


@pytest.mark.parametrize(
    ("digits", "response", "expected"),
    [
        ("53142", "12345", 1.0),
        ("53142", " 12345\n", 1.0),
        ("53142", "12345</s>", 1.0),
        ("5314", "1345 and more", 1.0),
        ("53142", "12354", 0.5 * 3 / 5),  # a permutation with 3 digits in place
        ("53142", "54321", 0.5 * 1 / 5),
        ("53142", "11111", 0.0),  # constant: not a permutation of the input
        ("53142", "1", 0.0),  # one token
        ("53142", "123456", 0.0),  # wrong length
        ("53142", "1234", 0.0),
        ("53142", "", 0.0),
        ("53142", "12a45", 0.0),
        ("1122", "1122", 1.0),
        ("1122", "2211", 0.0),  # a permutation with no digit in its sorted place
        ("1122", "2112", 0.25),
    ],
)
def test_score(digits: str, response: str, expected: float) -> None:
    assert demo_task.score(digits, response) == pytest.approx(expected)


def test_no_constant_or_one_token_answer_scores() -> None:
    _train, held = demo_task.split()
    for answer in ["0", "1", "9", "0000", "11111", "55555", "12345", "01234"]:
        mean = sum(demo_task.score(x, answer) for x in held) / len(held)
        assert mean < 0.05, (answer, mean)


def test_split_is_disjoint_and_deterministic() -> None:
    train, held = demo_task.split()
    assert not set(train) & set(held)
    assert len(held) > 400 and len(train) > 4000
    assert demo_task.split() == (train, held)
    assert all(len(set(x)) == len(x) and 4 <= len(x) <= 5 for x in train + held)


def test_random_answers_score_little() -> None:
    """Digits drawn at random (a stand-in for the initial model) stay far below the 0.2 ceiling."""
    import random

    rng = random.Random(0)
    _train, held = demo_task.split()
    mean = sum(demo_task.score(x, "".join(rng.sample(x, len(x)))) for x in held) / len(held)
    assert mean < 0.2, mean

"""The demo's verifiable toy task: sort a string of 4–5 distinct digits.

Prompt `"sort 53142="`, answer `"12345"`. The verifier gives partial credit only to an
answer that uses exactly the input's digits (a permutation), so neither a constant answer
nor a one-token answer can score: every input has at least four distinct digits.

    reward = 1.0                                          exact answer
           = 0.5 * (digits in their sorted place) / len   a permutation of the input's digits
           = 0.0                                          anything else (wrong digits, wrong
                                                          length, malformed, empty)
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROMPT_TEMPLATE = "sort {digits}="
MIN_DIGITS, MAX_DIGITS = 4, 5
HELD_OUT_BUCKET = 0  # inputs whose crc32 % 10 is this bucket are held out for evaluation


def target(digits: str) -> str:
    return "".join(sorted(digits))


def extract_answer(response: str) -> str:
    """The answer part of a response: up to the first whitespace or special-token marker (`<...>`)."""
    text = response.strip().split("<", 1)[0]
    return text.split()[0] if text.split() else ""


def score(digits: str, response: str) -> float:
    """The verifier: see the module docstring for the rule."""
    answer = extract_answer(response)
    expected = target(digits)
    if answer == expected:
        return 1.0
    if len(answer) != len(expected) or sorted(answer) != list(expected):
        return 0.0
    placed = sum(a == b for a, b in zip(answer, expected, strict=True))
    return 0.5 * placed / len(expected)


def _inputs(rng: random.Random, count: int) -> list[str]:
    """Distinct digits: with repeats allowed (60% of inputs), GRPO on the tiny model settles on
    sorting the *set* of digits (dropping repeats) and plateaus near 0.45 (measured). Distinct
    digits also mean every input has several distinct digits, so no constant answer scores."""
    found: set[str] = set()
    while len(found) < count:
        n = rng.randint(MIN_DIGITS, MAX_DIGITS)
        found.add("".join(rng.sample("0123456789", n)))
    return sorted(found)


def split(seed: int = 123, pool: int = 6000) -> tuple[list[str], list[str]]:
    """Training and held-out inputs, disjoint by a hash of the input."""
    inputs = _inputs(random.Random(seed), pool)
    held = [x for x in inputs if zlib.crc32(x.encode()) % 10 == HELD_OUT_BUCKET]
    train = [x for x in inputs if zlib.crc32(x.encode()) % 10 != HELD_OUT_BUCKET]
    return train, held


def records(inputs: list[str]) -> Iterator[dict[str, Any]]:
    for digits in inputs:
        yield {"prompt": PROMPT_TEMPLATE.format(digits=digits), "label": digits}


def write_jsonl(path: Path, inputs: list[str]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records(inputs)))


async def reward(args: Any, sample: Any) -> float:
    """A --custom-rm-path hook with slime's signature: the sample's label is the input digits."""
    return score(str(sample.label), sample.response)

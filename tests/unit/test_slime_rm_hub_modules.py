"""slime's reward modules and misc helpers under slime's names: `slime.rollout.rm_hub.{math_utils,
math_dapo_utils, deepscaler, f1, gpqa, ifbench}` and `slime.utils.misc`.

Expected values are slime's: the examples of slime's own tests/test_rm_*.py, and hand-made cases
worked out by reading slime's code (each says why). Nothing of slime's is run or copied here.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import signal
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tether.rollout.rewards.rules import rule_reward
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.utils.types import Sample as SlimeSample
from tether.runtime.errors import ConfigError

NEW_MODULES = (
    "slime.rollout.rm_hub.math_dapo_utils",
    "slime.rollout.rm_hub.deepscaler",
    "slime.rollout.rm_hub.f1",
    "slime.rollout.rm_hub.gpqa",
)
IFBENCH = "slime.rollout.rm_hub.ifbench"


def _forget_slime() -> None:
    finder.uninstall()
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def slime_names() -> Iterator[None]:
    """Each test sees `slime.*` served by tether's API, and leaves no import hook behind."""
    _forget_slime()
    assert finder.install()
    yield
    _forget_slime()


def _slime(name: str) -> Any:
    return importlib.import_module(f"slime.{name}")


# ----- the modules are served by slime's names -----
def test_each_module_is_tethers_module_under_slimes_name() -> None:
    for name in NEW_MODULES:
        assert name in finder.MIRRORED
        assert importlib.import_module(name) is importlib.import_module(finder.target_of(name))
    assert IFBENCH in finder.MIRRORED
    hub = _slime("rollout.rm_hub")
    # the names slime's rm_hub package imports from its modules are there too
    assert hub.compute_score_dapo is _slime("rollout.rm_hub.math_dapo_utils").compute_score
    assert (
        hub.get_deepscaler_rule_based_reward
        is _slime("rollout.rm_hub.deepscaler").get_deepscaler_rule_based_reward
    )
    assert hub.f1_score is _slime("rollout.rm_hub.f1").f1_score
    assert hub.compute_gpqa_reward is _slime("rollout.rm_hub.gpqa").compute_gpqa_reward
    assert hub.extract_boxed_answer is _slime("rollout.rm_hub.math_utils").extract_answer


def test_signatures_are_slimes() -> None:
    def params(module: str, fn: str) -> list[str]:
        return list(inspect.signature(getattr(_slime(module), fn)).parameters)

    mu, dapo = "rollout.rm_hub.math_utils", "rollout.rm_hub.math_dapo_utils"
    assert params(mu, "extract_answer") == ["passage"]
    assert params(mu, "extract_boxed_answer") == ["solution"]
    assert params(mu, "last_boxed_only_string") == ["string"]
    assert params(mu, "remove_boxed") == ["s"]
    assert params(mu, "mathd_normalize_answer") == ["answer"]
    assert (
        params(mu, "grade_answer_mathd")
        == params(mu, "grade_answer_sympy")
        == ["given_answer", "ground_truth"]
    )
    assert params(mu, "grade_answer_verl") == ["solution_str", "ground_truth"]
    assert params(dapo, "compute_score") == [
        "solution_str",
        "ground_truth",
        "strict_box_verify",
        "pause_tokens_index",
    ]
    assert params(dapo, "is_correct_minerva") == ["solution_str", "gt", "gt_need_extract", "answer_pattern"]
    assert params(dapo, "is_correct_strict_box") == ["pred", "gt", "pause_tokens_index"]
    assert params(dapo, "verify") == ["solution_str", "answer", "strict_box_verify", "pause_tokens_index"]
    assert params("rollout.rm_hub.deepscaler", "get_deepscaler_rule_based_reward") == ["response", "label"]
    assert params("rollout.rm_hub.f1", "f1_score") == ["prediction", "ground_truth"]
    assert params("rollout.rm_hub.gpqa", "compute_gpqa_reward") == ["response", "label", "metadata"]
    assert params("utils.misc", "load_function") == ["path"]
    assert params("utils.misc", "exec_command") == ["cmd", "capture_output"]


# ----- math_utils -----
def test_math_utils_boxed_strings_are_slimes() -> None:
    mu = _slime("rollout.rm_hub.math_utils")
    # slime's examples
    assert mu.last_boxed_only_string(r"first attempt \boxed{wrong}, final \boxed{42}") == r"\boxed{42}"
    assert mu.last_boxed_only_string(r"answer: \boxed{\frac{1}{2}}") == r"\boxed{\frac{1}{2}}"
    assert mu.last_boxed_only_string(r"answer: \fbox{7}") == r"\fbox{7}"
    assert mu.last_boxed_only_string("plain text, no box") is None
    assert mu.last_boxed_only_string(r"start \boxed{never closes") is None
    assert mu.remove_boxed(r"\boxed{x+1}") == "x+1"
    assert mu.remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert mu.remove_boxed("not boxed at all") is None and mu.remove_boxed(None) is None
    assert mu.extract_boxed_answer(r"Solution: \boxed{42}") == "42"
    assert mu.extract_answer("just 42") is None
    # hand-made: the string is returned as written, from `\boxed` to the brace that balances
    assert mu.last_boxed_only_string(r"\boxed 5 and {x}") == r"\boxed 5 and {x}"
    assert mu.remove_boxed(r"\boxed 5 and {x}") is None and mu.extract_answer(r"\boxed 5 and {x}") is None
    assert mu.last_boxed_only_string(r"\fbox{1} then \boxed{2}") == r"\boxed{2}"  # \fbox only without \boxed
    assert mu.remove_boxed(r"\fbox{7}") is None and mu.extract_boxed_answer(r"\fbox{7}") is None
    assert mu.extract_answer(r"so \boxed{x{y}} then \boxed{z}") == "z"
    # the last `\boxed` decides, even one without its brace: no answer, not an earlier one
    assert mu.extract_answer(r"\boxed{1} \boxed 2") is None
    assert mu.grade_answer_verl(r"\boxed{1} \boxed 2", "1") is False


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # slime's examples (of its _strip_string, which mathd_normalize_answer applies)
        (r"\frac12", r"\frac{1}{2}"),
        (r"\tfrac{1}{2}", r"\frac{1}{2}"),
        (r"\left(1\right)", "(1)"),
        (r"45^{\circ}", "45"),
        (r"45^\circ", "45"),
        (".7", "0.7"),
        ("0.5", r"\frac{1}{2}"),
        (".5", r"\frac{1}{2}"),
        ("3/4", r"\frac{3}{4}"),
        ("1 + 1", "1+1"),
        (r"\text{42}", "42"),
        # hand-made: "k = 5" loses a short left side; two "\text{ " unit parts cannot be
        # rewritten, nor can a bare \sqrt at the end, so the (stripped) answer comes back as given
        ("x = 5", "5"),
        (r" 5 \text{ a} \text{ b} ", r"5 \text{ a} \text{ b}"),
        (r"2\sqrt", r"2\sqrt"),
    ],
)
def test_mathd_normalize_answer(raw: str, expected: str) -> None:
    assert _slime("rollout.rm_hub.math_utils").mathd_normalize_answer(raw) == expected


def test_math_utils_grading_is_slimes() -> None:
    mu = _slime("rollout.rm_hub.math_utils")
    assert mu.mathd_normalize_answer(None) is None
    for given, truth in [
        (r"\frac{1}{2}", "0.5"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"45^\circ", "45"),
        ("3/4", r"\frac{3}{4}"),
    ]:
        assert mu.grade_answer_mathd(given, truth) is True
    assert mu.grade_answer_mathd("42", "43") is False
    assert mu.grade_answer_sympy("x+1", "1+x") is True
    assert mu.grade_answer_sympy(r"\frac{2}{4}", r"\frac{1}{2}") is False  # unreduced: compared as written
    assert mu.grade_answer_verl(r"answer: \boxed{42}", r"\boxed{42}") is True
    assert mu.grade_answer_verl("just 42", "42") is False
    assert mu.grade_answer_verl(r"\boxed{42}", "") is False
    # hand-made
    assert mu.grade_answer_sympy(r"\sqrt{8}", r"2\sqrt{2}") is True  # sqrt(8) - 2 sqrt(2) simplifies to 0
    assert mu.grade_answer_sympy("(1, 2]", "(1,2]") is True  # the same interval
    assert mu.grade_answer_sympy("(1,2)", "[1,2)") is False  # other brackets
    assert mu.grade_answer_sympy("2.0", "2") is True  # an integral float is the integer
    assert mu.grade_answer_sympy("1.5", "3/2") is True  # 3/2 is a fraction but 1.5 is not: sympy decides
    assert mu.grade_answer_verl(r"\fbox{3}", "3") is False  # only \boxed answers count
    assert mu.grade_answer_verl(r"\boxed{3}", r"\boxed 3") is False  # an unreadable boxed label is no label
    assert mu.grade_answer_verl(r"\boxed{3}", 3) is True
    assert mu.split_tuple("(1,000, 2]") == ["1000", "2"] and mu.split_tuple("") == []
    assert mu.split_tuple("((1,2),3)") == ["((1,2),3)"]  # nested: one element
    assert mu.should_allow_eval("x^{2}") is False and mu.should_allow_eval("2^10") is False
    assert mu.should_allow_eval("sqrt(x)+y") is True and mu.should_allow_eval("x+y+z") is False
    assert mu.count_unknown_letters_in_expr("sqrt(x)+frac(y)+z") == 3
    assert mu.are_equal_under_sympy("2*x", "x+x") is True and mu.are_equal_under_sympy("2", "3") is False
    assert (mu.BAD_SUBSTRINGS, mu.TUPLE_CHARS) == (["^{", "^("], "()[]")


# ----- deepscaler -----
def test_deepscaler_is_slimes() -> None:
    reward = _slime("rollout.rm_hub.deepscaler").get_deepscaler_rule_based_reward
    # slime's examples
    assert reward(r"Let me reconsider. \boxed{99}</think>Final: \boxed{42}", "42") == 1
    assert reward(r"Scratch work \boxed{wrong}###Response\boxed{42}", "42") == 1
    assert reward(r"\boxed{42}", "42") == 0
    assert reward("plain</think>no box here", "42") == 0
    assert reward(r"</think>\boxed{42}", "") == 0
    assert reward(r"</think>\boxed{42}", 42) == 1
    assert reward(r"</think>\boxed{42}", r"\boxed{42}") == 1
    assert reward(r"</think>\boxed{43}", "42") == 0
    assert reward(r"</think>\boxed{\frac{1}{2}}", "0.5") == 1
    # hand-made: the text after the first ###Response (slime takes split()[1]) ...
    assert reward(r"a###Response\boxed{1}###Response\boxed{2}", "1") == 1
    assert reward(r"a###Response\boxed{1}###Response\boxed{2}", "2") == 0
    # ... but after the last </think>
    assert reward(r"</think>\boxed{1}</think>\boxed{2}", "2") == 1
    assert reward(r"</think>\boxed{42}", 42.0) == 1  # "42.0" equals 42 under sympy's normalisation
    assert reward(r"</think>\boxed{3}", r"\boxed 3") == 0  # a boxed label that cannot be read


# ----- math_dapo_utils -----
def test_dapo_boxed_strings_differ_from_math_utils_as_slimes_do() -> None:
    dapo = _slime("rollout.rm_hub.math_dapo_utils")
    # slime's examples
    assert dapo.last_boxed_only_string(r"\boxed{first}, then \boxed{42}") == r"\boxed{42}"
    assert dapo.last_boxed_only_string(r"\boxed{\frac{1}{2}}") == r"\boxed{\frac{1}{2}}"
    assert dapo.last_boxed_only_string("no box") is None
    assert dapo.last_boxed_only_string(r"\boxed{never closes") is None
    assert dapo.remove_boxed(r"\boxed{42}") == "42"
    with pytest.raises(AssertionError, match="box error"):
        dapo.remove_boxed("not boxed")
    # hand-made: only `\boxed{` counts here (math_utils also reads `\boxed 2` and `\fbox`)
    assert dapo.last_boxed_only_string(r"\fbox{7}") is None
    assert dapo.last_boxed_only_string(r"\boxed{1} \boxed 2") == r"\boxed{1}"
    assert _slime("rollout.rm_hub.math_utils").last_boxed_only_string(r"\boxed{1} \boxed 2") is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # slime's examples
        ("x = 42", "42"),
        ("an answer", "answer"),
        ("42 square", "42"),
        ("100 dollars", "100"),
        (r"\text{hello}", "hello"),
        (r"\boxed{42}", "42"),
        ("1,234,567", "1234567"),
        ("a b c", "bc"),
        ("42<|endoftext|>", "42"),
        ("42<|im_end|>", "42"),
        # hand-made: TeX shorthand expanded inside $...$, then the $ dropped; spaces, then units
        # go, and only the $...$ part is kept; after the last "="
        (r"$\frac12$", r"\frac{1}{2}"),
        ("The answer is $5$ dollars.", "5"),
        ("x=1=2", "2"),
    ],
)
def test_normalize_final_answer(raw: str, expected: str) -> None:
    assert _slime("rollout.rm_hub.math_dapo_utils").normalize_final_answer(raw) == expected


def test_dapo_checks_are_slimes() -> None:
    dapo = _slime("rollout.rm_hub.math_dapo_utils")
    # slime's examples
    assert dapo.is_correct_strict_box(r"long preamble … \boxed{42}", "42") == (1, "42")
    assert dapo.is_correct_strict_box(r"\boxed{43}", "42") == (-1, "43")
    assert dapo.is_correct_strict_box("plain 42", "42") == (-1, None)
    assert dapo.is_correct_minerva("Long solution. Answer: 42", "42") == (True, "42")
    assert dapo.is_correct_minerva("Answer: 41 was a wrong guess.\nAnswer: 42", "42")[0] is True
    assert dapo.is_correct_minerva("just a number 42", "42")[0] is False
    assert dapo.verify(r"\boxed{42}", "42", strict_box_verify=True) == (True, "42")
    assert dapo.verify("Answer: 42", "42")[0] is True
    assert dapo.compute_score(r"\boxed{42}", "42", strict_box_verify=True) == {
        "score": 1.0,
        "acc": True,
        "pred": "42",
    }
    wrong = dapo.compute_score(r"\boxed{43}", "42", strict_box_verify=True)
    assert (wrong["score"], wrong["acc"]) == (-1.0, False)
    far = r"\boxed{42}" + " filler" * 60
    assert dapo.compute_score(far, "42", strict_box_verify=True)["score"] == -1.0  # past the last 300 chars
    # hand-made
    assert dapo.is_correct_minerva("no marker", "42") == (False, "[INVALID]")
    assert dapo.compute_score("work\nAnswer: 1,000", 1000.0) == {"score": 1.0, "acc": True, "pred": "1000"}
    assert dapo.is_correct_minerva("Answer: 12", r"it is \boxed{12}", gt_need_extract=True) == (True, "12")
    assert dapo.is_correct_minerva("Result = 7", "7", answer_pattern=r"Result\s*=\s*(\d+)") == (True, "7")
    with pytest.raises(ValueError):
        dapo.is_correct_minerva("Answer: x", "x")  # the Minerva check needs an integer ground truth
    assert dapo.compute_score(r"\boxed{x}", "x", strict_box_verify=True)["acc"] is True  # strict: any text
    assert dapo.compute_score(r"\boxed{42}", 42, strict_box_verify=True)["score"] == -1.0  # "42" != 42
    # the strict check reads from 100 characters before the fourth pause token's index
    text = "x" * 50 + r"\boxed{7}" + "y" * 200
    assert dapo.is_correct_strict_box(text, "7") == (-1, None)
    assert dapo.is_correct_strict_box(text, "7", pause_tokens_index=[0, 0, 0, 150]) == (1, "7")
    assert dapo.compute_score(text, "7", True, [0, 0, 0, 150])["acc"] is True
    with pytest.raises(AssertionError):
        dapo.is_correct_strict_box(text, "7", pause_tokens_index=[150])
    assert "<|im_end|>" in dapo.REMOVED_EXPRESSIONS and ("mbox", "text") in dapo.SUBSTITUTIONS


def test_dapo_timeout_raises_after_its_seconds() -> None:
    timeout = _slime("rollout.rm_hub.math_dapo_utils").timeout
    saved_handler = signal.getsignal(signal.SIGALRM)  # pytest-timeout's, restored below
    saved_timer = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        with timeout(seconds=5):
            pass
        assert signal.alarm(0) == 0  # leaving the block cancels the alarm
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="too slow"), timeout(1, "too slow"):
            time.sleep(5)
        assert time.monotonic() - start < 4
    finally:
        signal.signal(signal.SIGALRM, saved_handler)
        signal.setitimer(signal.ITIMER_REAL, *saved_timer)


# ----- f1 -----
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Quick Brown Fox.", "quick brown fox"),
        ("An apple, a day", "apple day"),
        ("HELLO   WORLD", "hello world"),
        ("a.b,c!", "abc"),
        ("", ""),
        ("the", ""),
    ],
)
def test_f1_normalize_answer(raw: str, expected: str) -> None:
    assert _slime("rollout.rm_hub.f1").normalize_answer(raw) == expected


def test_f1_score_is_slimes_triple() -> None:
    f1_score = _slime("rollout.rm_hub.f1").f1_score
    # slime's examples
    assert f1_score("Paris is the capital", "Paris is the capital") == (1.0, 1.0, 1.0)
    f1, precision, recall = f1_score("the brown fox", "a quick brown fox")
    assert (precision, recall) == (1.0, pytest.approx(2 / 3)) and f1 == pytest.approx(0.8)
    assert f1_score("apple banana", "carrot date") == (0, 0, 0)
    assert f1_score(None, "anything") == (0, 0, 0)
    for special in ("yes", "no", "noanswer"):
        assert f1_score(special, "some other phrase") == (0, 0, 0)
        assert f1_score("some other phrase", special) == (0, 0, 0)
    assert f1_score("yes", "yes") == (1.0, 1.0, 1.0)
    # hand-made: 1 shared token of 4 predicted and 2 expected: P 1/4, R 1/2, F1 2PR/(P+R) = 1/3
    assert f1_score("cat dog eel fox", "cat gnu") == (pytest.approx(1 / 3), 0.25, 0.5)
    assert f1_score("No.", "no") == (1.0, 1.0, 1.0)  # normalised first, then the yes/no rule
    assert rule_reward("f1", "cat dog eel fox", "cat gnu") == pytest.approx(1 / 3)  # rm_type f1: the F1


# ----- gpqa -----
@pytest.mark.parametrize(
    ("response", "letter"),
    [
        # slime's examples of the letter a response picks
        ("The answer is B.", "B"),
        ("Answer: C", "C"),
        ("My choice is D", "D"),
        ("A is correct here", "A"),
        ("E is the correct option", "E"),
        ("Final answer: B", "B"),
        ("the final option is C", "C"),
        ("we ruled out A, then B, settled on C", "C"),
        ("Let me think… Answer: A is wrong.</think>The answer is B.", "B"),
    ],
)
def test_gpqa_reads_the_letter_slime_reads(response: str, letter: str) -> None:
    reward = _slime("rollout.rm_hub.gpqa").compute_gpqa_reward
    assert reward(response, letter) == 1.0
    other = "A" if letter != "A" else "B"
    assert reward(response, other) == 0.0


def test_gpqa_reward_is_slimes() -> None:
    gpqa = _slime("rollout.rm_hub.gpqa")
    reward = gpqa.compute_gpqa_reward
    assert gpqa.DEFAULT_VALID_LETTERS == list("ABCDEFGHIJ")
    # slime's examples
    assert reward("The answer is C.", label="C") == 1.0
    assert reward("The answer is C.", label="D") == 0.0
    assert reward("Answer: C", label=2, metadata={"choices": ["alpha", "beta", "gamma", "delta"]}) == 1.0
    assert (
        reward("Answer: B", label=1, metadata={"choices": {"a": "first", "b": "second", "c": "third"}}) == 1.0
    )
    meta: dict[str, Any] = {"choices": ["London", "Capital of France", "Berlin"]}
    assert reward("I think the answer is B.", label="capital of france", metadata=meta) == 1.0
    assert meta["correct_answer"] == "Capital of France"  # slime records the matched choice
    assert (
        reward("Definitely paris.", label="Paris", metadata={"choices": ["London", "Paris", "Berlin"]}) == 1.0
    )
    assert reward("Answer: A", label="anything", metadata={"correct_letter": "a"}) == 1.0
    assert reward(None, label="A") == 0.0
    assert reward("random text", label="some answer") == 0.0
    # hand-made
    restricted = "Answer: C, but actually A was right, no wait B."
    assert reward(restricted, "B", {"valid_letters": ["A", "B"]}) == 1.0  # C is no option: last valid is B
    assert reward(restricted, "C") == 1.0  # with A-J, the phrase's C counts
    assert reward("The answer is B", "B", {"correct_letter": "C"}) == 0.0  # the metadata's letter wins
    assert reward("The answer is B", 1, {"correct_letter": "C"}) == 1.0  # ... but an index label wins over it
    assert reward("<think>the answer is B</think>hmm", "B") == 0.0  # the reasoning is not read
    assert reward("", "B") == 0.0


# ----- ifbench -----
FAKE_EVALUATION_LIB = """
import dataclasses

@dataclasses.dataclass
class InputExample:
    key: int
    instruction_id_list: list
    prompt: str
    kwargs: list

@dataclasses.dataclass
class Result:
    follow_all_instructions: bool

calls = []

def test_instruction_following_strict(inp, prompt_to_response):
    calls.append((inp, dict(prompt_to_response)))
    return Result("DONE" in prompt_to_response[inp.prompt])
"""


@pytest.fixture
def no_ifbench_module() -> Iterator[None]:
    """Neither slime's ifbench module nor `evaluation_lib` stays imported after the test."""
    names = ("evaluation_lib", IFBENCH, finder.target_of(IFBENCH))
    hub = importlib.import_module("tether.rollout.slime_api.rollout.rm_hub")
    for name in names:
        sys.modules.pop(name, None)
    yield
    for name in names:
        sys.modules.pop(name, None)
    if "ifbench" in vars(hub):
        delattr(hub, "ifbench")
    importlib.invalidate_caches()


@pytest.mark.usefixtures("no_ifbench_module")
def test_ifbench_without_ifbench_fails_at_import_naming_it() -> None:
    # slime imports IFBench's evaluation_lib when its ifbench module is imported (cloning IFBench
    # first); tether clones nothing, and says what is missing at the same point
    with pytest.raises(
        ModuleNotFoundError, match=r"slime\.rollout\.rm_hub\.ifbench needs IFBench's `evaluation_lib`"
    ):
        importlib.import_module(IFBENCH)
    _slime("rollout.rm_hub")  # the package itself imports without it, as slime's


@pytest.mark.usefixtures("no_ifbench_module")
def test_ifbench_scores_by_evaluation_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "evaluation_lib.py").write_text(FAKE_EVALUATION_LIB)
    monkeypatch.syspath_prepend(str(tmp_path))
    ifbench = importlib.import_module(IFBENCH)
    lib = ifbench.evaluation_lib
    assert ifbench.InputExample is lib.InputExample
    reward = ifbench.compute_ifbench_reward
    assert reward("DONE", None) == 0.0  # no metadata
    assert reward(None, None, metadata={"instruction_id_list": ["a"]}) == 0.0
    assert reward("DONE", None, metadata={"instruction_id_list": [None, " "]}) == 0.0  # no instruction
    assert lib.calls == []
    metadata = {
        "instruction_id_list": ["a", None, " b ", ""],
        "kwargs": [{"n": 3, "skip": None}],
        "prompt_text": None,
        "record_id": "7",
    }
    assert reward("all DONE", "ignored", metadata=metadata) == 1.0
    assert reward("not yet", "ignored", metadata=metadata) == 0.0
    example, responses = lib.calls[0]
    # ids cleaned, kwargs padded with the last one and without None values, the prompt "" for None
    assert (example.key, example.instruction_id_list, example.prompt) == (7, ["a", "b"], "")
    assert example.kwargs == [{"n": 3}, {"n": 3}] and responses == {"": "all DONE"}
    assert reward("DONE", None, metadata={"instruction_id_list": ["a", "b"], "kwargs": {"k": 1}}) == 1.0
    assert lib.calls[-1][0].kwargs == [{"k": 1}, {"k": 1}]  # one dict serves every instruction
    assert reward("DONE", None, metadata={"instruction_id_list": ["a"], "kwargs": [{}, {"x": 1}]}) == 1.0
    assert lib.calls[-1][0].kwargs == [{}]  # more kwargs than instructions: cut
    assert rule_reward("ifbench", "DONE", None, {"instruction_id_list": ["a"]}) == 1.0  # --rm-type ifbench


# ----- misc -----
def test_load_function_is_slimes_cached_one_argument_loader() -> None:
    misc = _slime("utils.misc")
    import os.path

    misc.load_function.cache_clear()
    assert misc.load_function("os.path.join") is os.path.join
    assert misc.load_function("os.path.join") is os.path.join
    assert misc.load_function.cache_info().hits == 1  # functools.cache, as slime's
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        misc.load_function("no_such_module_xyz.f")


def test_a_patched_load_function_is_what_tethers_callers_use(monkeypatch: pytest.MonkeyPatch) -> None:
    misc = _slime("utils.misc")
    hub = _slime("rollout.rm_hub")
    data_source = _slime("rollout.data_source")
    asked: list[str] = []

    async def reward(args: Any, sample: Any, **kwargs: Any) -> Any:
        return [0.25 for _ in sample] if isinstance(sample, list) else 0.5

    def keep_all(args: Any, buffer: list[Any], num_samples: int) -> list[Any]:
        return buffer

    def load_function(path: str) -> Any:  # one argument, as slime's
        asked.append(path)
        return keep_all if path == "my.filter" else reward

    monkeypatch.setattr(misc, "load_function", load_function)
    args = types.SimpleNamespace(custom_rm_path="my.reward", rm_type=None)
    assert asyncio.run(hub.async_rm(args, SlimeSample(response="x"))) == 0.5
    assert asyncio.run(hub.batched_async_rm(args, [SlimeSample(), SlimeSample()])) == [0.25, 0.25]
    sample = SlimeSample(response="x", custom_rm_path="per.sample")
    assert asyncio.run(hub.async_rm(types.SimpleNamespace(custom_rm_path=None), sample)) == 0.5
    source_args = types.SimpleNamespace(
        rollout_global_dataset=False, prompt_data=None, buffer_filter_path="my.filter"
    )
    assert data_source.RolloutDataSourceWithBuffer(source_args).buffer_filter is keep_all
    assert asked == ["my.reward", "my.reward", "per.sample", "my.filter"]


def test_a_hook_that_cannot_be_loaded_is_named_by_its_flag() -> None:
    hub = _slime("rollout.rm_hub")
    args = types.SimpleNamespace(custom_rm_path="no_such_module_xyz.reward", rm_type=None)
    with pytest.raises(
        ConfigError, match=r"--custom-rm-path='no_such_module_xyz\.reward': cannot be imported"
    ):
        asyncio.run(hub.async_rm(args, SlimeSample()))


def test_singleton_meta_keeps_slimes_instances_dict() -> None:
    SingletonMeta = _slime("utils.misc").SingletonMeta

    class First(metaclass=SingletonMeta):
        def __init__(self, value: int = 0) -> None:
            self.value = value

    class Second(metaclass=SingletonMeta):
        pass

    try:
        one = First(1)
        assert First(2) is one and one.value == 1  # later arguments are ignored
        second = Second()
        assert SingletonMeta._instances[First] is one and SingletonMeta._instances[Second] is second
        First.clear_instances()  # First gets a dict of its own; Second's instance stays
        assert First.__dict__["_instances"] == {}
        fresh = First(3)
        assert fresh is not one and fresh.value == 3 and First._instances == {First: fresh}
        assert Second() is second and SingletonMeta._instances[First] is one
    finally:
        SingletonMeta._instances.pop(First, None)
        SingletonMeta._instances.pop(Second, None)


def test_misc_helpers_are_slimes() -> None:
    misc = _slime("utils.misc")
    assert misc.group_by([1, 2, 3, 4, 5], key=lambda n: n % 2) == {1: [1, 3, 5], 0: [2, 4]}
    assert misc.group_by("abca") == {"a": ["a", "a"], "b": ["b"], "c": ["c"]}
    due = misc.should_run_periodic_action
    assert [r for r in range(10) if due(r, 4)] == [3, 7]
    assert [r for r in range(10) if due(r, 4, num_rollout_per_epoch=3)] == [2, 3, 5, 7, 8]
    assert due(8, 4, num_rollout=9) and not due(3, None)
    assert misc.Box(5).inner == 5

    def named(size: int) -> tuple[str, Any]:
        return f"p{size}", types.SimpleNamespace(nbytes=size)

    chunks = misc.chunk_named_params_by_size([named(3), named(4), named(2), named(10), named(1)], 8)
    # a chunk closes when the next tensor would bring it to 8 bytes or more
    assert [[name for name, _ in chunk] for chunk in chunks] == [["p3", "p4"], ["p2"], ["p10"], ["p1"]]


def test_decode_int32_meta_array() -> None:
    decode = _slime("utils.misc").decode_int32_meta_array
    values = np.array([1, -2, 300], dtype=np.int32)
    as_text = base64.b64encode(values.tobytes()).decode("ascii")
    for value in (as_text, values.tobytes(), [1, -2, 300], torch.tensor([1, -2, 300])):
        got = decode({"ids": value}, "ids")
        assert got is not None and got.dtype == torch.int32 and got.tolist() == [1, -2, 300]
    frozen = values.copy()
    frozen.flags.writeable = False
    got = decode({"b": frozen}, ("a", "b"))  # the first of the keys present
    assert got is not None and got.tolist() == [1, -2, 300]
    assert decode({"a": None}, ("a", "b")) is None and decode({}, "a") is None

"""slime's rule-based rewards (its rm_hub), scored by the same rules, written for tether.

`rule_reward(rm_type, response, label, metadata)` scores one response the way slime's `async_rm`
does for a rule-based `rm_type`:

    math        1 when the last \\boxed{} answer equals the label (Hendrycks' string
                normalisation, else sympy equality), else 0; no \\boxed{} scores 0
    deepscaler  `math` on the text after the last `</think>` (or after `###Response`); 0 when the
                response has neither marker
    dapo        {"score": 1.0 or -1.0, "acc": bool, "pred": str} from the last `Answer: ...` line in
                the response's last 300 characters, Minerva-normalised, against the integer label
    f1          token-level F1 between response and label (SQuAD normalisation)
    gpqa        1.0 when the chosen option letter (or the answer's text) is the right one, else 0.0
    ifbench     1.0 when every instruction in the metadata is followed (IFBench's strict check;
                needs IFBench's `evaluation_lib` importable)
    random      0 or 1 at random
    boxed_<t>   <t> on the contents of the response's last \\boxed{} ("" without one)

The pieces are public because slime's rm_hub modules (`tether.rollout.slime_api.rollout.rm_hub.*`)
expose them under slime's names: one implementation serves both. `exact_match` and `remote_rm` are
scored by tether.rollout.rewards.scoring.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from tether.rollout.rewards.types import (
    IFBENCH_MODULE,
    RULE_TYPES,
    missing_requirement,
    split_rm_type,
)


# ----- boxed answers -----
def _through_closing_brace(text: str, start: int) -> str | None:
    """`text` from `start` to the `}` that brings the brace count back to zero; None if none does."""
    depth = 0
    for pos in range(start, len(text)):
        ch = text[pos]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : pos + 1]
    return None


def last_boxed(text: str) -> str | None:
    """The last `\\boxed...}` of `text` as written (else the last `\\fbox...}`), braces balanced;
    None without one or when it never closes."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    return None if start < 0 else _through_closing_brace(text, start)


def unbox(boxed: str | None) -> str | None:
    """What a `\\boxed{...}` encloses; None for anything else (an `\\fbox{}`, None)."""
    prefix = "\\boxed{"
    if isinstance(boxed, str) and boxed.startswith(prefix) and boxed.endswith("}"):
        return boxed[len(prefix) : -1]
    return None


def boxed_content(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (balanced braces); None without one or when unclosed."""
    return unbox(last_boxed(text)) if "\\boxed" in text else None


# ----- Hendrycks (MATH) string normalisation -----
class _Unparsable(Exception):
    """The answer has a shape the normaliser cannot rewrite; it is compared as given."""


def _fix_fracs(s: str) -> str:
    head, *pieces = s.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if not piece:
            raise _Unparsable(s)
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return s
        num, second, rest = piece[0], piece[1], piece[2:]
        out.append(f"{{{num}}}{{{second}}}{rest}" if second != "{" else f"{{{num}}}{second}{rest}")
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if s == f"{num}/{den}" else s


def _fix_sqrt(s: str) -> str:
    head, *pieces = s.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _Unparsable(s)
        out.append("\\sqrt" + piece if piece[0] == "{" else f"\\sqrt{{{piece[0]}}}{piece[1:]}")
    return "".join(out)


def _hendrycks_strip(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # units written on the right
        unit_parts = s.split("\\text{ ")
        if len(unit_parts) != 2:
            raise _Unparsable(s)
        s = unit_parts[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 3" -> "3"
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def hendrycks_normalize(answer: str | None) -> str | None:
    """A MATH answer in Hendrycks' canonical text (as given when it cannot be rewritten)."""
    if answer is None:
        return None
    answer = answer.strip()
    whole_text = re.fullmatch(r"\\text\{(.+?)\}", answer)
    if whole_text is not None:
        answer = whole_text.group(1).strip()
    try:
        return _hendrycks_strip(answer)
    except _Unparsable:
        return answer


def grade_mathd(given: str | None, truth: str | None) -> bool:
    """Equal after Hendrycks' normalisation."""
    return hendrycks_normalize(truth) == hendrycks_normalize(given)


# ----- sympy equality -----
_UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
    "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_LATEX_SYMBOLS = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}


def _latex_to_plain(expr: str) -> str:
    from pylatexenc.latex2text import LatexNodes2Text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _LATEX_SYMBOLS.items():
        text = text.replace(symbol, name)
    return text.strip()


def _integral(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _drop_thousands_commas(expr: str) -> str:
    pattern = re.compile(r"(\d),(\d\d\d)($|\D)")
    while True:
        changed = pattern.sub(r"\1\2\3", expr)
        if changed == expr:
            return expr
        expr = changed


def _text_is_int(text: str) -> bool:
    try:
        return _integral(float(_drop_thousands_commas(text)))
    except ValueError:
        return False


def sympy_normalize(expr: str | None) -> str | None:
    """An answer as plain lower-case text sympy can parse: units, $, % and LaTeX removed."""
    if expr is None:
        return None
    whole_text = re.match(r"\\text\{(.+?)\}$", expr)  # `$`: a final newline may follow, as in slime
    if whole_text is not None:
        expr = whole_text.group(1)
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in (("million", "6"), ("billion", "9"), ("trillion", "12")):
        expr = expr.replace(word, f"*10^{power}")
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    try:
        as_float = float(expr)
    except ValueError:
        pass
    else:
        if _integral(as_float):
            expr = str(round(as_float))
    if "\\" in expr:
        try:
            expr = _latex_to_plain(expr)
        except Exception:  # LaTeX the converter cannot read stays as written
            pass
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # mixed numbers: "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _text_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


SYMPY_BAD_SUBSTRINGS = ("^{", "^(")
SYMPY_BAD_REGEXES = (r"\^[0-9]+\^", r"\^[0-9][0-9]+")
"""What makes sympy hang on an expression: such an answer is not handed to it."""
TUPLE_BRACKETS = "()[]"


def unknown_letters(expr: str) -> int:
    """How many distinct letters `expr` uses besides those of `sqrt` and `frac`."""
    return len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()})


def may_evaluate(expr: str) -> bool:
    """Whether sympy may be given `expr`: text and towers of powers can make it hang."""
    if unknown_letters(expr) > 2 or any(bad in expr for bad in SYMPY_BAD_SUBSTRINGS):
        return False
    return all(re.search(bad, expr) is None for bad in SYMPY_BAD_REGEXES)


def sympy_equal(truth: str, given: str) -> bool:
    """Whether `(truth)-(given)` simplifies to 0 (both already normalised); False when not tried."""
    return _sympy_zero(f"({truth})-({given})")


def _sympy_zero(expr: str) -> bool:
    import sympy
    from sympy.parsing import sympy_parser

    if not may_evaluate(expr):
        return False
    names = {k: v for k, v in vars(sympy).items() if not k.startswith("_")}
    transformations = (
        *sympy_parser.standard_transformations,
        sympy_parser.implicit_multiplication_application,
    )
    try:
        parsed = sympy_parser.parse_expr(
            expr.replace("^", "**"),
            local_dict={},
            global_dict={"__builtins__": {}, **names},
            transformations=transformations,
        )
        return bool(sympy.simplify(parsed) == 0)
    except Exception:  # what sympy cannot parse or simplify is "not equal"
        return False


def tuple_items(expr: str) -> list[str]:
    """The elements of a tuple or interval `(a,b]` (after dropping thousands separators), else [expr]."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in TUPLE_BRACKETS and expr[-1] in TUPLE_BRACKETS:
        if not any(ch in TUPLE_BRACKETS for ch in expr[1:-1]):
            return [item.strip() for item in expr[1:-1].split(",")]
    return [expr]


def _is_fraction(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def grade_sympy(given: str | None, truth: str | None) -> bool:
    """Equal after plain-text normalisation, element by element for tuples and intervals; an
    integer answer must match exactly and unreduced fractions are compared as written."""
    truth_n, given_n = sympy_normalize(truth), sympy_normalize(given)
    if truth_n is None or given_n is None:
        return False
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_items, given_items = tuple_items(truth_n), tuple_items(given_n)
    if len(truth_items) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False
    if len(truth_items) != len(given_items):
        return False
    for t, g in zip(truth_items, given_items, strict=True):
        if _is_fraction(t) and _is_fraction(g):
            same = t == g
        elif _text_is_int(t) != _text_is_int(g):
            same = False
        else:
            same = sympy_equal(t, g)
        if not same:
            return False
    return True


def grade_boxed_math(response: str, label: Any) -> bool:
    """The last \\boxed{} answer of the response against the label (itself boxed or plain)."""
    if not label:
        return False
    text = str(label)
    truth = boxed_content(text) if "\\boxed" in text else text
    given = boxed_content(response)
    if given is None:
        return False
    return grade_mathd(given, truth) or grade_sympy(given, truth)


def math_score(response: str, label: Any) -> int:
    """slime's `math`: 1 when the boxed answer is right, else 0."""
    return 1 if grade_boxed_math(response, label) else 0


def deepscaler_score(response: str, label: Any) -> int:
    """slime's `deepscaler`: the boxed answer after the reasoning (`</think>` or `###Response`)."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    given = boxed_content(solution)
    if given is None or label == "":
        return 0
    if not isinstance(label, str | int | float):
        raise ValueError(f"rm_type deepscaler needs a text or number label, got {type(label).__name__}")
    text = str(label)
    truth = boxed_content(text) if "\\boxed" in text else text
    if truth is None:
        return 0
    return 1 if grade_mathd(given, truth) or grade_sympy(given, truth) else 0


# ----- DAPO (Minerva normalisation, integer answers) -----
# Minerva's normalisation replaces these (old, new) pairs in order, then deletes MINERVA_REMOVED.
MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>",
)  # fmt: skip


def minerva_normalize(answer: Any) -> str:
    """A final answer in Minerva's canonical text (units, TeX wrappers and $ removed)."""
    s = str(answer).split("=")[-1]
    for old, new in MINERVA_SUBSTITUTIONS:
        s = s.replace(old, new)
    for word in MINERVA_REMOVED:
        s = s.replace(word, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for command in ("text", "textbf", "overline"):
        s = re.sub(rf"(\\{command}\{{)(.*?)(\}})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


DAPO_ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
"""Where a DAPO response states its answer: the text after `Answer:` on its line."""


def dapo_last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` of `text`, braces balanced; None without one or when unclosed.

    DAPO's own reading: only `\\boxed{` counts (no `\\fbox`, no `\\boxed x`)."""
    start = text.rfind("\\boxed{")
    return None if start < 0 else _through_closing_brace(text, start)


def dapo_unbox(boxed: str) -> str:
    """What `\\boxed{...}` encloses; anything else is a caller's mistake (AssertionError, as slime's)."""
    prefix = "\\boxed{"
    if boxed[: len(prefix)] != prefix or boxed[-1:] != "}":
        raise AssertionError(f"box error: {boxed}")
    return boxed[len(prefix) : -1]


def minerva_check(
    solution: str, truth: Any, truth_is_boxed: bool = False, answer_pattern: str = DAPO_ANSWER_PATTERN
) -> tuple[bool, str]:
    """(whether the solution's last `answer_pattern` match equals the integer truth, that match
    Minerva-normalised, or "[INVALID]" normalised when there is none)."""
    found = re.findall(answer_pattern, solution)
    pred = minerva_normalize(found[-1] if found else "[INVALID]")
    if truth_is_boxed:
        boxed = dapo_last_boxed(str(truth))
        if boxed is None:  # slime fails here too, unboxing None
            raise TypeError(f"the ground truth has no \\boxed{{...}}: {truth!r}")
        truth_text = minerva_normalize(dapo_unbox(boxed))
    else:
        truth_text = minerva_normalize(truth)
    try:
        expected = str(int(float(truth_text)))  # DAPO's answers are integers
    except ValueError as exc:
        raise ValueError(f"dapo needs an integer label (ground truth), got {truth!r}") from exc
    return pred == expected, pred


def strict_box_check(
    solution: str, truth: Any, pause_tokens_index: list[int] | None = None
) -> tuple[int, str | None]:
    """(1 when the last `\\boxed{}` near the end equals `truth` exactly, else -1; what it encloses).

    Near the end: the last 100 characters, or from 100 before the fourth pause token's index."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise AssertionError(f"pause_tokens_index needs 4 indices, got {pause_tokens_index!r}")
        tail = solution[pause_tokens_index[-1] - 100 :]
    else:
        tail = solution[-100:]
    boxed = dapo_last_boxed(tail)
    pred = dapo_unbox(boxed) if boxed is not None else None
    return (1 if pred == truth else -1), pred


def dapo_verify(
    solution: str,
    truth: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> tuple[bool, str | None]:
    """(correct, prediction): the strict boxed check, or by default the Minerva `Answer:` check."""
    if strict_box_verify:
        score, pred = strict_box_check(solution, truth, pause_tokens_index)
        return score == 1, pred
    return minerva_check(solution, truth)


def dapo_score(
    response: str,
    label: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """slime's `dapo`: {"score": 1.0 or -1.0, "acc", "pred"} for the response's last 300 characters
    (MATH-500's longest answer has 159), by `dapo_verify`."""
    correct, pred = dapo_verify(response[-300:], label, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ----- F1 -----
def squad_normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_parts(prediction: str | None, truth: Any) -> tuple[float, float, float]:
    """(F1, precision, recall) of the tokens after SQuAD normalisation; (0, 0, 0) for no prediction,
    no shared token, or a yes/no/noanswer on either side that the other does not equal."""
    if prediction is None:
        return (0, 0, 0)
    if not isinstance(truth, str):
        raise ValueError(f"f1 needs a text label (ground truth), got {truth!r}")
    pred, gold = squad_normalize(prediction), squad_normalize(truth)
    special = ("yes", "no", "noanswer")
    if (pred in special or gold in special) and pred != gold:
        return (0, 0, 0)
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return (0, 0, 0)
    precision, recall = 1.0 * same / len(pred_tokens), 1.0 * same / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall), precision, recall


def f1_score(response: str | None, label: Any) -> float:
    """slime's `f1`: the F1 of `f1_parts`."""
    return f1_parts(response, label)[0]


# ----- GPQA (multiple choice) -----
_LETTER_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
)


def _after_reasoning(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def chosen_letter(response: str | None, letters: Iterable[str]) -> str | None:
    """The option letter the response picks: by a phrase ("answer is B", "C is correct"), else the
    last standalone capital among `letters`; None when it names none."""
    if not response:
        return None
    text = _after_reasoning(response)
    valid = {letter.upper() for letter in letters}
    for pattern in _LETTER_PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def gpqa_score(response: str | None, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """slime's `gpqa`: the option letter the response picks (or the right option's text in it).

    The right option comes from metadata `correct_letter`, a letter label, an index label, or a label
    equal to one of metadata `choices`; `valid_letters` in the metadata overrides A.. (by choices, or A-J).
    """
    if not response:
        return 0.0
    meta = metadata if metadata is not None else {}
    choices = meta.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if meta.get("valid_letters"):
        letters = [str(x).upper() for x in meta["valid_letters"]]
    else:
        letters = list(string.ascii_uppercase[: len(choices) if choices else 10])
    given = meta.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in letters and not correct:
            correct = label_text.upper()
    elif isinstance(label, int | float) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    if not correct and choices and label_text:
        for i, choice in enumerate(choices):
            if _words(str(choice)) == _words(label_text):
                correct = letters[i]
                meta.setdefault("correct_answer", choice)
                break
    chosen = chosen_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    targets: list[str] = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(meta[key]) for key in ("correct_answer", "answer_text") if meta.get(key)]
    if label_text:
        targets.append(label_text)
    said = _words(_after_reasoning(response))
    if any(_words(t) and _words(t) in said for t in targets):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0


# ----- IFBench -----
def ifbench_score(response: str | None, metadata: dict[str, Any] | None) -> float:
    """slime's `ifbench`: 1.0 when the response follows every instruction of the metadata's
    `instruction_id_list` (with `kwargs`, `prompt_text`, `record_id`), by IFBench's strict check."""
    missing = missing_requirement("ifbench")
    if missing is not None:
        raise ModuleNotFoundError(f"rm_type ifbench {missing}")
    if not metadata or response is None:
        return 0.0
    ids = [str(x).strip() for x in metadata.get("instruction_id_list") or [] if x is not None]
    ids = [x for x in ids if x]
    if not ids:
        return 0.0
    raw = metadata.get("kwargs")
    if isinstance(raw, list):
        kwargs = [dict(k) if isinstance(k, dict) else {} for k in raw]
    elif isinstance(raw, dict):
        kwargs = [dict(raw) for _ in ids]
    else:
        kwargs = [{} for _ in ids]
    while len(kwargs) < len(ids):
        kwargs.append(dict(kwargs[-1]) if kwargs else {})
    kwargs = [{k: v for k, v in entry.items() if v is not None} for entry in kwargs[: len(ids)]]
    prompt = "" if metadata.get("prompt_text") is None else str(metadata["prompt_text"])
    lib = importlib.import_module(IFBENCH_MODULE)
    example = lib.InputExample(
        key=int(metadata.get("record_id") or 0), instruction_id_list=ids, prompt=prompt, kwargs=kwargs
    )
    result = lib.test_instruction_following_strict(example, {prompt: str(response)})
    return 1.0 if result.follow_all_instructions else 0.0


_SCORERS: dict[str, Callable[[str, Any, dict[str, Any]], Any]] = {
    "math": lambda r, label, m: math_score(r, label),
    "deepscaler": lambda r, label, m: deepscaler_score(r, label),
    "dapo": lambda r, label, m: dapo_score(r, label),
    "f1": lambda r, label, m: f1_score(r, label),
    "gpqa": gpqa_score,
    "ifbench": lambda r, label, m: ifbench_score(r, m),
    "random": lambda r, label, m: random.randint(0, 1),
}


def rule_reward(rm_type: str, response: str, label: Any, metadata: dict[str, Any] | None = None) -> Any:
    """Score one response by a rule-based `rm_type` (with an optional `boxed_` prefix), as slime does."""
    base, boxed = split_rm_type(rm_type)
    if boxed:
        response = boxed_content(response) or ""
    scorer = _SCORERS.get(base)
    if scorer is None:
        raise ValueError(
            f"rm_type {rm_type!r} is not a rule-based reward; rule-based: {', '.join(RULE_TYPES)}"
        )
    return scorer(response, label, metadata if metadata is not None else {})

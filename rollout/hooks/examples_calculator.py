"""An example tool-calling generate hook: the model may write `<calc>EXPR</calc>`; the tool answers.

Use with `--custom-generate-function-path tether.rollout.hooks.examples_calculator.generate` and
`--custom-rm-path tether.rollout.hooks.examples_calculator.reward`. Each model turn stops at `</calc>`;
the tool's answer `<result>VALUE</result>` is appended as an observation (loss_mask 0) and the
model continues, up to MAX_TOOL_CALLS calls. The tool evaluates arithmetic only (numbers,
+ - * / ** and parentheses), by walking the parsed expression, never with eval().
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from tether.rollout.hooks.multi_turn import append_model_tokens, append_observation, generate_turn
from tether.rollout.rewards.scoring import math_reward
from tether.rollout.rollout_fn import current_context
from tether.rollout.sample import Sample, SampleStatus

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
MAX_TOOL_CALLS = 4
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> float:
    """Value of an arithmetic expression; CalculatorError for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {expression!r}") from exc

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise CalculatorError("exponent too large")
            return float(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return float(_UNARY[type(node.op)](walk(node.operand)))
        raise CalculatorError(f"unsupported element {type(node).__name__} in {expression!r}")

    try:
        return walk(tree)
    except ZeroDivisionError as exc:
        raise CalculatorError("division by zero") from exc


def tool_answer(call_text: str) -> str:
    """The observation for the text of a model turn that ended in a tool call."""
    expression = call_text.rsplit(CALL_OPEN, 1)[-1].removesuffix(CALL_CLOSE)
    try:
        value = calculate(expression)
        shown = str(int(value)) if value.is_integer() else f"{value:.6g}"
    except CalculatorError as exc:
        shown = f"error: {exc}"
    return f"<result>{shown}</result>"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's custom-generate signature: a multi-turn calculator trajectory in one Sample."""
    ctx = current_context()
    if ctx.tokenizer is None:
        raise RuntimeError("the calculator example needs the tokenizer in the RolloutContext")
    sample.session_id = sample.session_id or f"calc-{sample.group_index}-{sample.index}"
    budget = sampling_params.get("max_new_tokens")
    stops = [*sampling_params.get("stop", []), CALL_CLOSE]
    for _ in range(MAX_TOOL_CALLS + 1):
        params = {**sampling_params, "stop": stops}
        if budget is not None:
            left = int(budget) - sample.response_length
            if left <= 0:
                sample.status = SampleStatus.TRUNCATED
                return sample
            params["max_new_tokens"] = left
        resp = await generate_turn(ctx, sample, params)
        append_model_tokens(sample, resp.output_ids, resp.log_probs(), resp.text, resp.weight_version)
        finish = resp.finish_type
        if finish == "abort":
            sample.status = SampleStatus.ABORTED
            return sample
        if finish == "length":
            sample.status = SampleStatus.TRUNCATED
            return sample
        if not resp.text.endswith(CALL_CLOSE) or CALL_OPEN not in resp.text:
            break
        observation = tool_answer(resp.text)
        append_observation(sample, ctx.tokenizer.encode(observation, add_special_tokens=False), observation)
    sample.status = SampleStatus.COMPLETED if sample.response_length else SampleStatus.FAILED
    return sample


async def reward(args: Any, sample: Sample) -> float:
    """1.0 when the final answer (after the last tool result) equals the label."""
    final = sample.response.rsplit("</result>", 1)[-1]
    return math_reward(final, sample.label)

"""`slime.agent.parsing`: one decoded model output as reasoning, visible text and tool calls.

The formats are SGLang's: with SGLang importable, its `ReasoningParser` and `FunctionCallParser`
read the output (as slime does); without it (tether's own rollout process), tether reads the same
formats itself: reasoning between `<think>` and `</think>` (the output may start inside the
reasoning for the parsers marked `forced` below) and tool calls in the `qwen25`/`qwen`/`hermes`
formats the CPU engine reads too (`tether.rollout.engine_api.tool_formats`). Tool calls in the
Anthropic-style XML some coding models emit (`<tool_call><function=NAME><parameter=P>V
</parameter></function></tool_call>`) are read as a fallback. An output forced into SGLang's
JSON array of calls (a required tool choice, see `adapters.common`) is read by `parse_json_calls`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from tether.rollout.engine_api.tool_formats import FORMATS, ToolDef, parse_tool_calls

logger = logging.getLogger(__name__)

THINK_PARSERS: dict[str, bool] = {
    "qwen3": False,
    "qwen3-thinking": True,
    "deepseek-r1": True,
    "deepseek-v3": False,
    "glm45": False,
    "kimi_k2": False,
    "minimax": True,
    "minimax-append-think": False,
    "step3": True,
}
"""Reasoning parsers tether reads without SGLang: name -> whether the output starts inside the
reasoning (no opening `<think>`)."""

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ParsedModelOutput:
    """What one model output says: its reasoning, its visible text and its tool calls."""

    reasoning: str
    text: str
    tool_uses: list[dict[str, Any]]
    """Each call as {"name": ..., "input": {arguments}}."""
    ill_formed: bool = False
    """A call's arguments were not JSON (kept raw under `_raw_arguments`)."""


def _sglang_available() -> bool:
    try:
        import sglang.srt.function_call.function_call_parser  # noqa: F401
    except Exception:
        return False
    return True


def check_parsers(tool_parser_name: str | None, reasoning_parser_name: str | None) -> None:
    """Refuse a parser name neither SGLang (when importable) nor tether reads, naming the known ones."""
    if _sglang_available():
        return
    if tool_parser_name and tool_parser_name not in FORMATS:
        raise ValueError(
            f"tool_parser={tool_parser_name!r}: not a format tether reads without SGLang "
            f"(known: {', '.join(sorted(FORMATS))})"
        )
    if reasoning_parser_name and reasoning_parser_name not in THINK_PARSERS:
        raise ValueError(
            f"reasoning_parser={reasoning_parser_name!r}: not a format tether reads without SGLang "
            f"(known: {', '.join(sorted(THINK_PARSERS))})"
        )


def split_reasoning(raw_output: str, parser_name: str) -> tuple[str, str]:
    """(reasoning, the rest) of an output, by `parser_name`'s `<think>` convention."""
    if _sglang_available():
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        reasoning, body = ReasoningParser(model_type=parser_name, stream_reasoning=False).parse_non_stream(
            raw_output
        )
        return reasoning or "", body or ""
    forced = THINK_PARSERS.get(parser_name)
    if forced is None:
        check_parsers(None, parser_name)
    text = raw_output
    if text.lstrip().startswith("<think>"):
        text = text.lstrip()[len("<think>") :]
    elif not forced:
        return "", raw_output
    if "</think>" not in text:
        # Reasoning cut short (max tokens): all of it is reasoning, as SGLang reads it.
        return text.strip(), ""
    reasoning, body = text.split("</think>", 1)
    return reasoning.strip(), body


def _arguments(raw: Any) -> tuple[dict[str, Any], bool]:
    """Arguments as a dict, and whether they were ill-formed."""
    if isinstance(raw, dict):
        return raw, False
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {"_raw_arguments": raw}, True
    return (value, False) if isinstance(value, dict) else ({"_raw_arguments": raw}, True)


def parse_tool_uses(
    body_text: str, tools_schema: list[dict[str, Any]] | None, tool_parser_name: str | None
) -> tuple[str, list[dict[str, Any]], bool]:
    """(visible text, tool uses, ill_formed) of the body after reasoning."""
    uses: list[dict[str, Any]] = []
    ill_formed = False
    if tool_parser_name and tools_schema:
        calls: list[tuple[str, Any]] = []
        if _sglang_available():
            from sglang.srt.entrypoints.openai.protocol import Function, Tool
            from sglang.srt.function_call.function_call_parser import FunctionCallParser

            parser = FunctionCallParser(
                tools=[Tool(type="function", function=Function(**t["function"])) for t in tools_schema],
                tool_call_parser=tool_parser_name,
            )
            if parser.has_tool_call(body_text):
                try:
                    body_text, found = parser.parse_non_stream(body_text)
                    calls = [(c.name or "tool", c.parameters) for c in found]
                except Exception:
                    logger.exception("SGLang's tool-call parser failed; reading the XML form instead")
        else:
            check_parsers(tool_parser_name, None)
            tools = msgspec.convert(tools_schema, list[ToolDef])
            body_text, found_calls = parse_tool_calls(body_text, FORMATS[tool_parser_name], tools)
            calls = [(c.name, c.arguments) for c in found_calls]
        for name, raw in calls:
            args, bad = _arguments(raw)
            ill_formed |= bad
            uses.append({"name": name, "input": args})
    if not uses and tools_schema:
        body_text, uses = parse_xml_tool_uses(body_text, tools_schema)
    return body_text, uses, ill_formed


def parse_xml_tool_uses(
    body_text: str, tools_schema: list[dict[str, Any]]
) -> tuple[str, list[dict[str, Any]]]:
    """Calls in the XML form to declared tools, and the text with those calls cut out."""
    declared = {t.get("function", {}).get("name") for t in tools_schema}
    uses: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _XML_CALL.finditer(body_text):
        name = match.group(1)
        if name not in declared:
            continue
        params = {p.group(1): p.group(2).strip() for p in _XML_PARAM.finditer(match.group(2))}
        uses.append({"name": name, "input": params})
        kept.append(body_text[last : match.start()])
        last = match.end()
    kept.append(body_text[last:])
    return "".join(kept), uses


def parse_json_calls(body_text: str) -> tuple[list[dict[str, Any]], bool]:
    """Tool uses of an output forced into SGLang's JSON array `[{"name", "parameters"}, ...]`."""
    try:
        items = json.loads(body_text)
    except ValueError:
        return [], True
    if not isinstance(items, list):
        return [], True
    uses: list[dict[str, Any]] = []
    ill_formed = False
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            ill_formed = True
            continue
        args, bad = _arguments(item.get("parameters", item.get("arguments", {})))
        ill_formed |= bad
        uses.append({"name": item["name"], "input": args})
    return uses, ill_formed


def parse_model_output(
    raw_output: str,
    *,
    tools_schema: list[dict[str, Any]] | None,
    tool_parser_name: str | None,
    reasoning_parser_name: str | None,
    forced_json_calls: bool = False,
) -> ParsedModelOutput:
    """Reasoning, text and tool uses of one decoded output (see the module docstring)."""
    reasoning, body = "", raw_output
    if reasoning_parser_name:
        reasoning, body = split_reasoning(raw_output, reasoning_parser_name)
        if not reasoning and "</think>" in body:
            reasoning, body = body.split("</think>", 1)
    if forced_json_calls:
        uses, ill_formed = parse_json_calls(body.strip())
        return ParsedModelOutput(reasoning=reasoning, text="", tool_uses=uses, ill_formed=ill_formed)
    body, uses, ill_formed = parse_tool_uses(body, tools_schema, tool_parser_name)
    return ParsedModelOutput(
        reasoning=reasoning, text=(body or "").strip(), tool_uses=uses, ill_formed=ill_formed
    )


__all__ = [
    "ParsedModelOutput",
    "check_parsers",
    "parse_json_calls",
    "parse_model_output",
    "parse_tool_uses",
    "parse_xml_tool_uses",
    "split_reasoning",
]

"""Tool calls in model output, in the formats SGLang's `--tool-call-parser` names: read by the CPU
engine's chat endpoint and by slime.agent's adapters alike (constraining them is the CPU engine's).

Formats (SGLang 0.5's detectors of the same names):
- `qwen25` (alias `qwen`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call; content is the text before the first block.
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an unterminated last
  block is read too.
A call to a function the request did not declare is dropped, as SGLang does by default.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

import msgspec

ParserName = Literal["qwen25", "qwen", "hermes"]
PARSERS: tuple[str, ...] = ("qwen25", "qwen", "hermes")


class ToolFormat(msgspec.Struct, frozen=True, kw_only=True):
    bot: str
    """What starts a call."""
    eot: str
    """What ends a call."""
    begin: str
    """The constrained prefix of one call; `{name}` stands for the function's name."""
    end: str
    """The constrained suffix of one call, after the arguments."""
    unterminated_last: bool = False
    """Whether a last call without `eot` is read too (hermes)."""


FORMATS: dict[str, ToolFormat] = {
    "qwen25": ToolFormat(
        bot="<tool_call>\n",
        eot="\n</tool_call>",
        begin='<tool_call>\n{{"name":"{name}", "arguments":',
        end="}\n</tool_call>",
    ),
    "hermes": ToolFormat(
        bot="<tool_call>",
        eot="</tool_call>",
        begin='<tool_call>{{"name":"{name}", "arguments":',
        end="}</tool_call>",
        unterminated_last=True,
    ),
}
FORMATS["qwen"] = FORMATS["qwen25"]


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    function: FunctionDef
    type: str = "function"


class ParsedCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str
    """The arguments as JSON text."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, fmt: ToolFormat, tools: list[ToolDef]) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a model's output: the text before the first call, and every complete
    call to a declared function."""
    at = text.find(fmt.bot)
    if at == -1:
        return text, []
    content = text[:at].strip()
    names = {t.function.name for t in tools}
    pattern = re.escape(fmt.bot) + r"(.*?)" + re.escape(fmt.eot)
    if fmt.unterminated_last:
        pattern += "|" + re.escape(fmt.bot) + r"(.*)"
    calls: list[ParsedCall] = []
    for found in re.finditer(pattern, text, re.DOTALL):
        raw = next((g for g in found.groups() if g), "")
        try:
            parsed = json.loads(raw.strip())
        except ValueError:
            continue  # a malformed block is skipped; the others still count
        for act in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(act, dict) or act.get("name") not in names:
                continue
            arguments = act.get("parameters") or act.get("arguments", {})
            calls.append(
                ParsedCall(name=str(act["name"]), arguments=json.dumps(arguments, ensure_ascii=False))
            )
    return content, calls


def holdback(text: str, fmt: ToolFormat) -> int:
    """Where streamed content must stop: before a call starts, or before a tail of `text` that
    may be the start of one."""
    at = text.find(fmt.bot)
    if at != -1:
        return at
    for n in range(min(len(fmt.bot) - 1, len(text)), 0, -1):
        if fmt.bot.startswith(text[-n:]):
            return len(text) - n
    return len(text)


__all__ = [
    "FORMATS",
    "PARSERS",
    "FunctionDef",
    "ParsedCall",
    "ParserName",
    "ToolDef",
    "ToolFormat",
    "holdback",
    "new_call_id",
    "parse_tool_calls",
]

"""Tool calls in model output, as SGLang's `--tool-call-parser` constrains them (the formats and
their reading live in tether.rollout.engine_api.tool_formats, re-exported here).

Formats (SGLang 0.5's detectors of the same names):
- `qwen25` (alias `qwen`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call; content is the text before the first block.
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an unterminated last
  block is read too.
A call to a function the request did not declare is dropped, as SGLang does by default.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.cpu_engine.constrained import (
    Alt,
    GrammarConstraint,
    JAny,
    Lit,
    Node,
    Seq,
    Vocab,
    schema_node,
)
from tether.rollout.engine_api.tool_formats import (
    FORMATS,
    PARSERS,
    ParsedCall,
    ToolDef,
    ToolFormat,
    holdback,
    new_call_id,
    parse_tool_calls,
)


def _arguments(tool: ToolDef) -> Node:
    # SGLang's structural tag holds the schema only for strict functions; any JSON otherwise.
    return schema_node(tool.function.parameters) if tool.function.strict else JAny()


def structural_constraint(fmt: ToolFormat, tools: list[ToolDef], vocab: Vocab) -> GrammarConstraint:
    """With a parser: the output starts with one call to one of `tools`, then free text."""
    calls = tuple(
        Seq((Lit(fmt.begin.format(name=t.function.name)), _arguments(t), Lit(fmt.end))) for t in tools
    )
    return GrammarConstraint(head=Alt(calls), vocab=vocab, then_free=True)


def json_array_constraint(tools: list[ToolDef], vocab: Vocab, parallel: bool = True) -> GrammarConstraint:
    """Without a parser: a JSON array of calls `[{"name": ..., "parameters": {...}}]` (one call
    unless `parallel`, SGLang's parallel_tool_calls), then the end."""
    items = []
    for t in tools:
        params = t.function.parameters or {"type": "object", "properties": {}}
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return GrammarConstraint(head=schema_node(schema), vocab=vocab, then_free=False)


__all__ = [
    "FORMATS",
    "PARSERS",
    "ParsedCall",
    "ToolDef",
    "ToolFormat",
    "holdback",
    "json_array_constraint",
    "new_call_id",
    "parse_tool_calls",
    "structural_constraint",
]

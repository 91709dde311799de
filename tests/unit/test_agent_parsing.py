"""slime.agent's parsing as tether reads it without SGLang: `<think>` reasoning by parser name,
tool calls in the qwen25 and hermes formats (the CPU engine's), the XML fallback some coding
models write, the JSON array a forced tool choice produces, and unknown parser names refused."""

from __future__ import annotations

import pytest

from tether.rollout.slime_api.agent import parsing
from tether.rollout.slime_api.agent.parsing import check_parsers, parse_json_calls, parse_model_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(autouse=True)
def without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parsing, "_sglang_available", lambda: False)


def parse(raw: str, *, tool: str | None = "qwen25", think: str | None = None, forced: bool = False):
    return parse_model_output(
        raw, tools_schema=TOOLS, tool_parser_name=tool, reasoning_parser_name=think, forced_json_calls=forced
    )


def test_qwen25_and_hermes_calls_are_read_and_the_text_before_them_kept() -> None:
    out = parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert (out.text, out.tool_uses, out.ill_formed) == (
        "Let me look.",
        [{"name": "get_weather", "input": {"city": "Paris"}}],
        False,
    )
    # hermes reads an unterminated last call (the output stopped at the stop token)
    hermes = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo"}}', tool="hermes")
    assert hermes.tool_uses == [{"name": "get_weather", "input": {"city": "Tokyo"}}]


def test_a_call_to_an_undeclared_tool_or_without_a_parser_is_text() -> None:
    raw = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse(raw).tool_uses == []
    plain = parse('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', tool=None)
    assert plain.tool_uses == [] and "get_weather" in plain.text


def test_the_xml_form_is_read_when_the_parser_finds_nothing() -> None:
    raw = "ok <tool_call><function=get_weather><parameter=city>\nParis\n</parameter></function></tool_call> done"
    out = parse(raw)
    assert out.tool_uses == [{"name": "get_weather", "input": {"city": "Paris"}}]
    assert out.text == "ok  done"


@pytest.mark.parametrize(
    ("parser", "raw", "reasoning", "text"),
    [
        ("qwen3", "<think>\nweigh it\n</think>\n\nIt rains.", "weigh it", "It rains."),
        ("qwen3", "It rains.", "", "It rains."),  # qwen3 may answer without thinking
        ("deepseek-r1", "weigh it</think>It rains.", "weigh it", "It rains."),  # starts inside
        ("deepseek-r1", "still weighing", "still weighing", ""),  # cut short: all reasoning
    ],
)
def test_reasoning_is_split_by_the_parsers_convention(
    parser: str, raw: str, reasoning: str, text: str
) -> None:
    out = parse(raw, tool=None, think=parser)
    assert (out.reasoning, out.text) == (reasoning, text)


def test_a_forced_json_array_of_calls_is_read_and_bad_arguments_flagged() -> None:
    out = parse('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', forced=True)
    assert out.tool_uses == [{"name": "get_weather", "input": {"city": "Paris"}}] and not out.ill_formed
    uses, bad = parse_json_calls('[{"name": "get_weather", "parameters": "city=Paris"}]')
    assert bad and uses == [{"name": "get_weather", "input": {"_raw_arguments": "city=Paris"}}]
    assert parse_json_calls('[{"name": "get_weather", "parameters": {}') == ([], True)  # cut off


def test_unknown_parser_names_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"tool_parser='llama4'.*known: hermes, qwen, qwen25"):
        check_parsers("llama4", None)
    with pytest.raises(ValueError, match=r"reasoning_parser='o1'.*deepseek-r1"):
        check_parsers(None, "o1")
    check_parsers("qwen25", "qwen3")

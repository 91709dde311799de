"""The CPU engine's OpenAI layer without a server: the tool-call grammar and its vocabulary masks,
the tool-call parser, and turning OpenAI chat turns into one Sample (rollout/openai_turns.py)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import torch

from tether.rollout.cpu_engine.constrained import GrammarConstraint, Vocab, schema_node
from tether.rollout.cpu_engine.http.tool_calls import (
    FORMATS,
    ToolDef,
    holdback,
    json_array_constraint,
    parse_tool_calls,
    structural_constraint,
)
from tether.rollout.cpu_engine.sampling import SamplingParams, choose_tokens
from tether.rollout.openai_turns import Turn, TurnDrift, continuation_ids, sample_from_turns

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer"},
        "note": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["city", "days"],
}


def whole(schema: Any, text: str) -> bool:
    return len(text) in schema_node(schema).match(text, 0).ends


def prefix(schema: Any, text: str) -> bool:
    m = schema_node(schema).match(text, 0)
    return m.partial or len(text) in m.ends


@pytest.mark.parametrize(
    "text",
    [
        '{"city":"Paris","days":3}',
        '{"city": "Rome", "days": -12, "note": "a \\"b\\" \\u00e9"}',
        '{"city":"Paris","days":0,"tags":["x","y"]}',
        '{"city":"Paris","days":1,"note":"","tags":[]}',
    ],
)
def test_schema_accepts_its_documents(text: str) -> None:
    json.loads(text)
    assert whole(SCHEMA, text)


@pytest.mark.parametrize(
    "text",
    [
        '{"city":"Berlin","days":3}',  # not in the enum
        '{"days":3,"city":"Paris"}',  # properties come in the schema's order
        '{"city":"Paris"}',  # a required property is missing
        '{"city":"Paris","days":1.5}',  # not an integer
        '{"city":"Paris","days":1,"tags":["a","b","c"]}',  # maxItems
        '{"city":"Paris","days":1,"extra":1}',  # no undeclared property
        '{ "city":"Paris","days":1}',  # compact: no whitespace but after ':' and ','
        '{"city":"Paris","days":01}',
    ],
)
def test_schema_refuses_other_documents(text: str) -> None:
    assert not whole(SCHEMA, text)


def test_prefixes_are_viable_until_they_cannot_be() -> None:
    doc = '{"city":"Paris","days":12,"tags":["a"]}'
    for i in range(len(doc)):
        assert prefix(SCHEMA, doc[:i]), doc[:i]
    assert not prefix(SCHEMA, '{"ci"ty')
    assert not prefix(SCHEMA, '{"city":"Pa"')
    any_json = {}
    for text in ('[1, {"a": [true, null]}, "x", -0.5e+3]', "false", '{"k":{}}'):
        assert whole(any_json, text), text
    assert not prefix(any_json, "[1,,")


def test_refs_and_any_of() -> None:
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}],
    }
    assert whole(schema, '{"kids":[{"kids":[]},{}]}') and whole(schema, "null")
    assert not whole(schema, '{"kids":[1]}')
    with pytest.raises(ValueError, match="only local references"):
        schema_node({"$ref": "http://example.com/schema"})


@cache
def char_vocab() -> Vocab:
    """Single characters and a few longer pieces, EOS = 0."""
    texts: list[str | None] = [None, *[chr(c) for c in range(32, 127)], "\n", '{"', "</tool_call>", "ab"]
    return Vocab(texts, eos_ids=[0])


def decode(vocab: Vocab, ids: list[int]) -> str:
    return "".join(vocab.texts[t] or "" for t in ids)


def greedy_under(constraint: GrammarConstraint, scores: torch.Tensor, steps: int) -> list[int]:
    """Decode with `constraint`, always taking the highest-scored allowed token."""
    out: list[int] = []
    for _ in range(steps):
        mask = constraint.allowed(out)
        if mask is None:
            break
        logits = scores.masked_fill(~mask, float("-inf"))
        tok = int(logits.argmax())
        out.append(tok)
        if tok in constraint.vocab.eos_ids:
            break
    return out


def test_a_forced_named_call_comes_out_whole_under_any_scores() -> None:
    vocab = char_vocab()
    tool = json_tool(
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris"]}},
            "required": ["city"],
        },
    )
    for seed in range(5):
        scores = torch.randn(vocab.size, generator=torch.Generator().manual_seed(seed))
        constraint = structural_constraint(FORMATS["qwen25"], [tool], vocab)
        out = greedy_under(constraint, scores, 200)
        text = decode(vocab, out)
        assert constraint.allowed(out) is None  # the call is complete: free text from here on
        content, calls = parse_tool_calls(text, FORMATS["qwen25"], [tool])
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]


def test_without_a_parser_a_json_array_of_calls_then_the_end() -> None:
    vocab = char_vocab()
    tool = json_tool("ping", {"type": "object", "properties": {}, "additionalProperties": False})
    constraint = json_array_constraint([tool], vocab, parallel=False)
    out = greedy_under(constraint, torch.randn(vocab.size, generator=torch.Generator().manual_seed(1)), 300)
    assert out[-1] == 0  # the end-of-sequence token, allowed only once the array is whole
    calls = json.loads(decode(vocab, out[:-1]))
    assert calls == [{"name": "ping", "parameters": {}}]


def json_tool(name: str, parameters: dict[str, Any], strict: bool = True) -> ToolDef:
    import msgspec

    return msgspec.convert(
        {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}, ToolDef
    )


def test_masked_rows_sample_only_allowed_tokens_and_report_top_logprobs() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[3, 7]] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    choice = choose_tokens(logits, params, gens, False, masks=[mask, mask], top_logprobs=[3, 0])
    assert all(t in (3, 7) for t in choice.tokens)
    top = choice.top[0]
    assert top is not None and len(top) == 3 and top[0][1] == choice.tokens[0]
    assert abs(top[0][0] - choice.logprobs[0]) < 1e-6 and top[2][0] == float("-inf")
    masked = torch.log_softmax(logits[0].masked_fill(~mask, float("-inf")), -1)
    assert abs(choice.logprobs[0] - float(masked[choice.tokens[0]])) < 1e-6
    assert choice.top[1] is None


def test_tool_call_parsing_as_sglang_reads_it() -> None:
    tools = [json_tool("ping", {}), json_tool("add", {})]
    qwen = FORMATS["qwen25"]
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call><tool_call>\n{"name":"ping", "arguments":true}\n</tool_call>junk'
    content, calls = parse_tool_calls(text, qwen, tools)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("add", '{"a": 1}'),
        ("ping", "true"),
    ]
    assert parse_tool_calls("no call here", qwen, tools) == ("no call here", [])
    content, calls = parse_tool_calls(
        '<tool_call>{"name": "ping", "parameters": {"x": 2}}', FORMATS["hermes"], tools
    )
    assert [(c.name, c.arguments) for c in calls] == [
        ("ping", '{"x": 2}')
    ]  # hermes reads an unterminated call
    assert holdback("hello <tool", qwen) == len("hello ") and holdback("hi\n<tool_call>\n{", qwen) == 3
    assert holdback("plain", qwen) == 5


# ----- rollout/openai_turns.py -----


def chat_response(prompt: list[int], out: list[int], lps: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "choices": [
            {
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "stop",
                "prompt_token_ids": prompt,
                "response_token_ids": out,
                "logprobs": {
                    "content": [{"token": "t", "bytes": [1], "logprob": v, "top_logprobs": []} for v in lps]
                },
                **extra,
            }
        ],
        "metadata": {"weight_version": "v3"},
    }


def test_turns_become_one_sample_with_only_model_tokens_trained() -> None:
    one = Turn.from_response(chat_response([1, 2, 3], [10, 11], [-0.1, -0.2]))
    two = Turn.from_response(chat_response([1, 2, 3, 10, 11, 7, 8], [12], [-0.3]))
    sample = sample_from_turns([one, two], prompt="p")
    assert sample.tokens == [1, 2, 3, 10, 11, 7, 8, 12] and sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert sample.weight_versions == ["v3"]
    assert sample.metadata["provenance"] == [["model", 2], ["tool", 2], ["model", 1]]
    with pytest.raises(TurnDrift, match=r"turn 1.*first difference at token 3"):
        sample_from_turns([one, Turn.from_response(chat_response([1, 2, 3, 99, 11, 7], [12], [-0.3]))])


def test_turn_reads_meta_info_and_refuses_missing_ids() -> None:
    meta = {"output_token_logprobs": [[-0.5, 10, "a"], [-0.25, 11, "b"]], "weight_version": "w"}
    body = chat_response([1], [10, 11], [0.0, 0.0], meta_info=meta)
    turn = Turn.from_response(body)
    assert turn.output_log_probs == [-0.5, -0.25] and turn.weight_version == "v3"
    with pytest.raises(ValueError, match="return_token_ids"):
        Turn.from_response({"choices": [{"message": {}, "logprobs": {"content": []}}]})
    with pytest.raises(ValueError, match="logprobs=True"):
        Turn.from_response({"choices": [{"prompt_token_ids": [1], "response_token_ids": [2]}]})


def test_continuation_ids_append_only_the_new_messages() -> None:
    from tether.rollout.cpu_engine.modeling.tiny_model import build_tokenizer

    tok: Any = build_tokenizer(48)
    user = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    # an output the tokenizer would not produce from its text (byte pieces instead of merges)
    output = [*(tok.convert_tokens_to_ids(c) for c in "The"), tok.convert_tokens_to_ids("<|im_end|>")]
    tool = [{"role": "tool", "content": "5"}]
    ids = continuation_ids(tok, [*prompt_ids, *output], tool)
    assert ids[: len(prompt_ids) + len(output)] == [*prompt_ids, *output]  # nothing before is re-tokenized
    full = tok.apply_chat_template(
        [*user, {"role": "assistant", "content": "The"}, *tool], tokenize=False, add_generation_prompt=True
    )
    assert (
        tok.decode(ids, skip_special_tokens=False) == full
    )  # the same text as the template's whole rendering

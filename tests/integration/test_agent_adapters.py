"""slime.agent's adapters driven by the official `openai` and `anthropic` clients against a real CPU
engine: multi-turn tool use yields Samples whose trained tokens are exactly the tokens the engine
generated (checked by replaying each trained span greedily on the engine), whose mask covers only
those, and a conversation that rewrites its history yields a second branch.

One engine serves the module; each test runs its adapter on the test's own event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from support.engines import ENGINE_KEY, Engine, start_cpu_engine, stop_engine
from support.net import free_port
from transformers import AutoTokenizer

from tether.rollout.slime_api.agent.adapters import AnthropicAdapter, OpenAIAdapter
from tether.rollout.slime_api.agent.adapters.common import BaseAdapter
from tether.rollout.slime_api.utils.types import Sample

GREEDY = {"temperature": 0.0}
WEATHER_OPENAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
        },
    },
}
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_OPENAI["function"]["parameters"],
}


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = start_cpu_engine(tiny_model, tmp_path_factory.mktemp("agent-engine"))
    try:
        yield e
    finally:
        stop_engine(e)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


@asynccontextmanager
async def serving(adapter: BaseAdapter) -> AsyncIterator[str]:
    runner = web.AppRunner(adapter.app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def trained_spans(sample: Sample) -> list[tuple[int, int]]:
    """[start, end) of each run of loss-mask 1, as positions in sample.tokens."""
    assert sample.loss_mask is not None
    offset = len(sample.tokens) - sample.response_length
    spans, start = [], None
    for i, m in enumerate([*sample.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((offset + start, offset + i))
            start = None
    return spans


def assert_engine_generated(engine: Engine, sample: Sample, schemas: dict[int, str]) -> None:
    """Each trained span is what the engine generates greedily after the tokens before it (with
    the span's forced JSON schema, if any), with the same log-probs."""
    assert sample.rollout_log_probs is not None and sample.loss_mask is not None
    offset = len(sample.tokens) - sample.response_length
    for k, (start, end) in enumerate(trained_spans(sample)):
        sp: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": end - start, "no_stop_trim": True}
        sp["skip_special_tokens"] = False
        if k in schemas:
            sp["json_schema"] = schemas[k]
        status, out = engine.request(
            "/generate", {"input_ids": sample.tokens[:start], "sampling_params": sp, "return_logprob": True}
        )
        assert status == 200, out
        entries = out["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == sample.tokens[start:end], f"span {k}"
        assert [e[0] for e in entries] == pytest.approx(
            sample.rollout_log_probs[start - offset : end - offset], abs=1e-5
        )


def forced_schema() -> str:
    from tether.rollout.slime_api.agent.adapters.common import ForcedTools, forced_calls_schema

    return forced_calls_schema([WEATHER_OPENAI], ForcedTools(None, True))


def test_openai_client_tool_use_trains_exactly_the_generated_tokens(engine: Engine, tokenizer: Any) -> None:
    async def main() -> list[Sample]:
        adapter = OpenAIAdapter(
            tokenizer=tokenizer, sglang_url=engine.url, tool_parser="qwen25", engine_api_key=ENGINE_KEY
        )
        adapter.open_session("s-openai", sampling_defaults=GREEDY)
        async with (
            serving(adapter) as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="s-openai", max_retries=0) as client,
        ):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You answer questions about weather."},
                {"role": "user", "content": "What is the weather in Paris?"},
            ]
            first = await client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER_OPENAI], tool_choice="required", max_tokens=96
            )
            call = first.choices[0].message.tool_calls[0]
            assert first.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] in {"Paris", "Tokyo"}
            messages += [
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
            ]
            second = await client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER_OPENAI], max_tokens=6
            )
            messages += [
                {"role": "assistant", "content": second.choices[0].message.content},
                {"role": "user", "content": "thanks"},
            ]
            # The third turn streams: the SDK assembles the chunks.
            stream = await client.chat.completions.create(
                model="m", messages=messages, tools=[WEATHER_OPENAI], max_tokens=5, stream=True
            )
            chunks = [c async for c in stream]
            assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
            base = Sample(index=3, group_index=1, prompt="weather", label="x")
            return await adapter.finish_session("s-openai", base_sample=base, reward=1.0)

    samples = asyncio.run(main())
    assert len(samples) == 1
    sample = samples[0]
    spans = trained_spans(sample)
    assert len(spans) == 3  # the three model turns, and nothing else
    assert sample.reward == 1.0 and sample.index == 3 and sample.metadata["use_tool"] is True
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_log_probs)
    context = tokenizer.decode(sample.tokens[spans[0][1] : spans[1][0]])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in context
    assert "thanks" in tokenizer.decode(sample.tokens[spans[1][1] : spans[2][0]])
    assert_engine_generated(engine, sample, {0: forced_schema()})


def test_anthropic_client_tool_use_streamed_and_a_rewritten_history_branches(
    engine: Engine, tokenizer: Any
) -> None:
    async def main() -> list[Sample]:
        adapter = AnthropicAdapter(
            tokenizer=tokenizer, sglang_url=engine.url, tool_parser="qwen25", engine_api_key=ENGINE_KEY
        )
        adapter.open_session("s-anthropic", sampling_defaults=GREEDY)
        async with (
            serving(adapter) as url,
            anthropic.AsyncAnthropic(base_url=url, api_key="s-anthropic", max_retries=0) as client,
        ):
            system = "You answer questions about weather."
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Tokyo?"}]
            first = await client.messages.create(
                model="m",
                system=system,
                messages=messages,
                tools=[WEATHER_ANTHROPIC],
                tool_choice={"type": "any"},
                max_tokens=96,
            )
            assert first.stop_reason == "tool_use"
            use = next(b for b in first.content if b.type == "tool_use")
            assert use.name == "get_weather" and use.input["city"] in {"Paris", "Tokyo"}
            messages += [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}],
                },
            ]
            async with client.messages.stream(
                model="m", system=system, messages=messages, tools=[WEATHER_ANTHROPIC], max_tokens=6
            ) as stream:
                second = await stream.get_final_message()
            assert second.stop_reason in {"end_turn", "max_tokens"}
            count = await client.messages.count_tokens(model="m", system=system, messages=messages)
            assert count.input_tokens > 0
            # Compaction: the agent replaces its history by a summary; the session branches.
            compacted = [{"role": "user", "content": "Summary: Tokyo has rain. Say goodbye."}]
            await client.messages.create(model="m", system=system, messages=compacted, max_tokens=4)
            base = Sample(index=0, group_index=0, prompt="weather")
            return await adapter.finish_session("s-anthropic", base_sample=base, reward=0.5)

    samples = asyncio.run(main())
    assert len(samples) == 2  # the tool conversation and the compacted branch
    tool_branch, compacted = samples
    assert len(trained_spans(tool_branch)) == 2 and len(trained_spans(compacted)) == 1
    assert "<tool_response>\nrain\n</tool_response>" in tokenizer.decode(tool_branch.tokens)
    assert "Summary: Tokyo has rain" in tokenizer.decode(compacted.tokens)
    assert "Tokyo?" not in tokenizer.decode(compacted.tokens)
    assert all(s.reward == 0.5 for s in samples)
    assert_engine_generated(engine, tool_branch, {0: forced_schema()})
    assert_engine_generated(engine, compacted, {})


def test_turn_cap_and_closed_sessions_are_refused(engine: Engine, tokenizer: Any) -> None:
    async def main() -> None:
        adapter = OpenAIAdapter(
            tokenizer=tokenizer, sglang_url=engine.url, max_turns_per_sid=1, engine_api_key=ENGINE_KEY
        )
        async with (
            serving(adapter) as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="s-cap", max_retries=0) as client,
        ):
            msgs = [{"role": "user", "content": "hello"}]
            await client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
            with pytest.raises(openai.RateLimitError, match="max_turns_per_sid=1"):
                await client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
            samples = await adapter.finish_session("s-cap", base_sample=Sample(index=0))
            assert len(samples) == 1
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
            assert await adapter.finish_session("s-cap", base_sample=Sample(index=0)) == []

    asyncio.run(main())

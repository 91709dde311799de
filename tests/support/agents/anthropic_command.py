"""A command agent on the official `anthropic` SDK: the SDK finds the adapter and the session key
in ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY, the question comes on stdin. It makes the model call
its tool once (tool_choice names it), runs it, lets the model answer, and prints the answer."""

from __future__ import annotations

import sys

import anthropic

TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
        "required": ["city"],
    },
}
WEATHER = {"Paris": "WEATHER-RESULT rain", "Tokyo": "WEATHER-RESULT sun"}


def main() -> None:
    client = anthropic.Anthropic(max_retries=0)
    messages: list[dict] = [{"role": "user", "content": sys.stdin.read()}]
    first = client.messages.create(
        model="tether-policy",
        max_tokens=64,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=messages,
    )
    (call,) = [block for block in first.content if block.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": WEATHER[call.input["city"]]}
            ],
        },
    ]
    answer = client.messages.create(model="tether-policy", max_tokens=32, tools=[TOOL], messages=messages)
    print("".join(block.text for block in answer.content if block.type == "text"))


if __name__ == "__main__":
    main()

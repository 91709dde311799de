"""A small agent written with the OpenAI Agents SDK (`openai-agents`): two function tools, the
model made to call one on its first turn (tool_choice "required", which the adapter enforces with
a grammar, so even the tiny random test model calls it), then free to answer. Each tool call is
appended to $TETHER_TEST_AGENT_LOG as a JSON line."""

from __future__ import annotations

import json
import os
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tether.rollout.agents import AgentRun

City = Literal["Paris", "Tokyo"]
WEATHER = {"Paris": "WEATHER-RESULT rain", "Tokyo": "WEATHER-RESULT sun"}
POPULATION = {"Paris": "POPULATION-RESULT two million", "Tokyo": "POPULATION-RESULT fourteen million"}


def _log(tool: str, city: str) -> None:
    with open(os.environ["TETHER_TEST_AGENT_LOG"], "a") as f:
        f.write(json.dumps({"tool": tool, "city": city}) + "\n")


@function_tool
def get_weather(city: City) -> str:
    """The weather in a city."""
    _log("get_weather", city)
    return WEATHER[city]


@function_tool
def get_population(city: City) -> str:
    """How many people live in a city."""
    _log("get_population", city)
    return POPULATION[city]


async def agent(run: AgentRun) -> str:
    set_tracing_disabled(True)  # no trace export: the adapter is the only endpoint there is
    client = AsyncOpenAI(base_url=run.openai_base_url, api_key=run.api_key, max_retries=0)
    weather_agent = Agent(
        name="weather",
        instructions="Answer with the help of the tools.",
        tools=[get_weather, get_population],
        model=OpenAIChatCompletionsModel(model=run.model, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False),
        reset_tool_choice=True,  # after a tool ran the model may answer
    )
    result = await Runner.run(weather_agent, run.prompt_text, max_turns=4)
    return str(result.final_output)


def reward(args: object, sample: object) -> float:
    """Scores the agent's output (the entry hands it over as the response), spread so a group has
    a gradient; logs what it saw."""
    response = getattr(sample, "response", "")
    with open(os.environ["TETHER_TEST_AGENT_LOG"], "a") as f:
        f.write(json.dumps({"reward_response": response}) + "\n")
    return float(len(response) % 4) / 3.0

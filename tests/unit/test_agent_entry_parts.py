"""The agent entry's parts on their own: the agent flags refused where they cannot apply, a
callable's failure, the adapter refusing a key that names no open session, and the --sglang-*
values hooks read under slime's names. (A command agent's run: tests/integration/test_agent_command.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from support.agents import SAMPLE_RUN

from tether.rollout.agents.program import AgentRun, run_callable
from tether.rollout.config import AGENT_ENTRY, RolloutConfig
from tether.rollout.slime_api.agent.adapters import OpenAIAdapter
from tether.rollout.slime_api.args import sglang_flag_values
from tether.runtime.errors import ConfigError

RUN = SAMPLE_RUN


@pytest.mark.parametrize(
    ("fields", "flag", "why"),
    [
        ({"agent_command": "./agent"}, "--agent-command", "only applies with"),
        ({"agent_api": "anthropic"}, "--agent-api", "only applies with"),
        ({"agent_max_turns": 3}, "--agent-max-turns", "only applies with"),
        ({"custom_generate_function_path": AGENT_ENTRY}, "--agent-function-path", "exactly one"),
        (
            {
                "custom_generate_function_path": AGENT_ENTRY,
                "agent_command": "a",
                "agent_function_path": "m.f",
            },
            "--agent-function-path",
            "exactly one",
        ),
        (
            {"custom_generate_function_path": AGENT_ENTRY, "agent_command": "a", "group_rm": True},
            "--group-rm",
            "by itself",
        ),
    ],
)
def test_agent_flags_are_refused_where_they_cannot_apply(fields: dict, flag: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as refused:
        RolloutConfig(**fields)
    assert str(refused.value).startswith(flag)


def test_the_agent_entry_takes_one_agent() -> None:
    cfg = RolloutConfig(
        custom_generate_function_path=AGENT_ENTRY, agent_command="./agent", agent_api="anthropic"
    )
    assert cfg.agent_command == "./agent" and cfg.agent_api == "anthropic"


def test_a_raising_or_slow_callable_ends_its_run_with_the_reason() -> None:
    async def raises(run: AgentRun) -> str:
        raise RuntimeError(f"no tools for {run.model}")

    async def stalls(run: AgentRun) -> str:
        await asyncio.Event().wait()
        return "never"

    crashed = asyncio.run(run_callable(raises, RUN, time_budget_sec=30))
    assert crashed.exit_code == 1 and crashed.error == "RuntimeError: no tools for tether-policy"
    late = asyncio.run(run_callable(stalls, RUN, time_budget_sec=0.05))
    assert late.exit_code == -1 and "time budget" in (late.error or "")


def test_an_adapter_for_the_entry_refuses_a_key_that_names_no_open_session(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    adapter = OpenAIAdapter(
        tokenizer=AutoTokenizer.from_pretrained(str(tiny_model)),
        sglang_url="http://127.0.0.1:9",
        require_open_sessions=True,
    )

    async def ask() -> tuple[int, dict]:
        async with TestClient(TestServer(adapter.app)) as client:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer guessed"},
            )
            return reply.status, await reply.json()

    status, body = asyncio.run(ask())
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "guessed" not in adapter.store


def test_sglang_flags_read_under_slimes_names() -> None:
    values = sglang_flag_values(
        ["--tool-call-parser", "qwen25", "--dp-size", "2", "--enable-metrics", "--mem-fraction-static=0.5"]
    )
    assert values == {
        "sglang_tool_call_parser": "qwen25",
        "sglang_dp_size": 2,
        "sglang_enable_metrics": True,
        "sglang_mem_fraction_static": 0.5,
    }

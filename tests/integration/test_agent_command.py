"""A command agent as the agent entry runs it (bash, in a process group of its own): what it is
given (the adapter and the session key, the prompt on stdin, never the engine key), its time
budget (the whole group killed), its failure reported with its output. Starts bash only."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.agents import SAMPLE_RUN

from tether.rollout.agents.program import run_command

RUN = SAMPLE_RUN


def test_a_command_agent_gets_the_session_and_the_prompt_but_not_the_engine_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TETHER_ENGINE_API_KEY", "engine-secret")
    script = (
        'python3 -c \'import json, os, sys; print(json.dumps({"stdin": sys.stdin.read(), '
        '"env": {k: v for k, v in os.environ.items() if k.startswith(("OPENAI", "ANTHROPIC", "TETHER"))}}))\''
    )
    result = asyncio.run(run_command(script, RUN, time_budget_sec=30))
    assert result.exit_code == 0 and result.error is None
    seen = json.loads(result.output)
    assert seen["stdin"] == "2+2?"
    env = seen["env"]
    assert "TETHER_ENGINE_API_KEY" not in env and "engine-secret" not in json.dumps(env)
    assert (
        env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
        and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    )
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == env["ANTHROPIC_AUTH_TOKEN"] == "agent-key"
    assert json.loads(env["TETHER_AGENT_MESSAGES"]) == RUN.prompt
    assert json.loads(env["TETHER_AGENT_LABEL"]) == "4" and json.loads(env["TETHER_AGENT_METADATA"]) == {
        "task": "arith"
    }


def test_a_command_past_its_budget_is_killed_with_what_it_started(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    result = asyncio.run(run_command(f"sleep 60 & echo $! > {marker}; wait", RUN, time_budget_sec=1))
    assert result.exit_code == -1 and "time budget" in (result.error or "")
    pid = int(marker.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_failing_command_ends_its_run_with_its_output_and_the_reason() -> None:
    failed = asyncio.run(run_command("echo partial; echo broken >&2; exit 3", RUN, time_budget_sec=30))
    assert (failed.exit_code, failed.output) == (3, "partial") and "broken" in (failed.error or "")

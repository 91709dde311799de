"""The agent a sample runs: a Python callable or a command, pointed at one adapter session.

Either way the agent sees the same things (`AgentRun`): the adapter's URL, the session's key (the
session id: it names the session and is the only credential the agent gets; the run's engine key
never reaches it), the model label, the sample's prompt and its record. What it answers (the
callable's return value, the command's standard output) is the agent's output, which the reward
hook scores as the sample's response.

A command runs in a process group of its own with the environment below, the prompt on standard
input, and is killed (the whole group) when its time budget runs out; a callable is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

AgentApi = Literal["openai", "anthropic"]

OUTPUT_LIMIT_BYTES = 1 << 20
"""Standard output a command may leave as its answer (the rest is cut, and noted)."""

SECRET_ENV_PREFIXES = ("TETHER_ENGINE_API_KEY",)
"""Environment variables a command never inherits (the run's engine key)."""


@dataclass(frozen=True)
class AgentRun:
    """What one agent run is given. `openai_base_url` suits the `openai` client (`…/v1`),
    `base_url` the `anthropic` one (it appends `/v1/messages` itself)."""

    base_url: str
    api_key: str
    model: str
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def prompt_text(self) -> str:
        """The prompt as one text: itself, or the last user message's text of a message list."""
        if isinstance(self.prompt, str):
            return self.prompt
        for message in reversed(self.prompt):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return ""

    def environment(self) -> dict[str, str]:
        """The variables a command agent gets (its SDK finds the endpoint and key by itself)."""
        return {
            "OPENAI_BASE_URL": self.openai_base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "ANTHROPIC_AUTH_TOKEN": self.api_key,
            "TETHER_AGENT_MODEL": self.model,
            "TETHER_AGENT_PROMPT": self.prompt_text,
            "TETHER_AGENT_MESSAGES": json.dumps(
                self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": self.prompt}]
            ),
            "TETHER_AGENT_LABEL": json.dumps(self.label, default=str),
            "TETHER_AGENT_METADATA": json.dumps(dict(self.metadata), default=str),
        }


@dataclass
class AgentResult:
    """How an agent run ended: its output, its exit code (0 for a callable that returned, -1 when
    the time budget ran out, 1 for a callable that raised) and why, when it did not end well."""

    output: str
    exit_code: int
    error: str | None = None


AgentCallable = Callable[[AgentRun], Awaitable[Any]]


async def run_callable(fn: AgentCallable, run: AgentRun, *, time_budget_sec: float) -> AgentResult:
    """`await fn(run)` within the budget; its return value (as text) is the output."""
    try:
        async with asyncio.timeout(time_budget_sec):
            answer = await fn(run)
    except TimeoutError:
        return AgentResult("", -1, f"time budget of {time_budget_sec:g}s ran out")
    except Exception as exc:  # the agent's own failure ends its run, not the rollout
        return AgentResult("", 1, f"{type(exc).__name__}: {exc}")
    return AgentResult(_as_text(answer), 0)


async def run_command(
    command: str, run: AgentRun, *, time_budget_sec: float, cwd: str | None = None
) -> AgentResult:
    """Run `command` with `bash -c`, the run's variables in its environment and the prompt on its
    standard input; its standard output is the output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_ENV_PREFIXES)}
    env.update(run.environment())
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group: the budget kills everything it started
    )
    try:
        async with asyncio.timeout(time_budget_sec):
            out, err = await proc.communicate(run.prompt_text.encode())
    except TimeoutError:
        _kill_group(proc)
        await proc.wait()
        return AgentResult("", -1, f"time budget of {time_budget_sec:g}s ran out")
    finally:
        if proc.returncode is None:  # cancelled from outside: leave nothing running
            _kill_group(proc)
            await asyncio.shield(proc.wait())
    code = proc.returncode if proc.returncode is not None else -1
    output = out[:OUTPUT_LIMIT_BYTES].decode(errors="replace").strip()
    error = None
    if code != 0:
        error = f"exited {code}: {err[-2000:].decode(errors='replace').strip()}"
    return AgentResult(output, code, error)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _as_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, str):
        return answer
    final = getattr(answer, "final_output", None)  # an openai-agents RunResult
    if final is not None:
        return str(final)
    return str(answer)

"""`slime.agent.harness.claude_code`: Anthropic's Claude Code CLI as a harness.

The CLI talks to the Anthropic adapter as if it were Anthropic's API: `ANTHROPIC_BASE_URL` is the
adapter, and `ANTHROPIC_AUTH_TOKEN`, the key it sends, is the session id the adapter files the
turns under. It runs headless (`-p`, permissions bypassed and pre-acknowledged in its config),
streaming JSON events into the run's log.

Host settings: SLIME_AGENT_NODE_TARBALL and SLIME_AGENT_CC_TARBALL (the Node 22 and CLI
tarballs uploaded by `install_cli`), SLIME_AGENT_CC_EXTRA_ARGS (appended to the command line),
SLIME_AGENT_CC_EXTRA_ENVS (a JSON object merged into the CLI's environment last, so it may
override the defaults).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import ClassVar

from tether.rollout.slime_api.agent.harness.common import (
    CliHarness,
    HarnessContext,
    extra_envs,
    install_npm_cli,
    with_extra_args,
)
from tether.rollout.slime_api.agent.sandbox import Sandbox


class ClaudeCodeHarness(CliHarness):
    """Claude Code (`claude -p`) against the Anthropic adapter."""

    name = "claude_code"

    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CC_TARBALL"
    extra_args_env = "SLIME_AGENT_CC_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CC_EXTRA_ENVS"

    binary = "/usr/local/bin/claude"
    launch_flags = (
        "--permission-mode bypassPermissions --output-format stream-json --include-partial-messages "
        "--include-hook-events --verbose"
    )
    static_env: ClassVar[dict[str, str]] = {
        # no telemetry, update checks or beta headers: the adapter is the only endpoint there is
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }
    settings: ClassVar[dict[str, bool]] = {
        "hasCompletedOnboarding": True,
        "bypassPermissionsModeAccepted": True,
    }
    """Written to ~/.claude.json and ~/.claude/settings.json, so the CLI starts without asking."""

    async def install_cli(self, sb: Sandbox) -> None:
        await install_npm_cli(
            sb,
            node_runtime=Path(os.environ[self.node_tarball_env]),
            npm_package=Path(os.environ[self.cli_tarball_env]),
            check_cmd=f"ls -la {self.binary} && {self.binary} --version",
        )

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        await sb.exec(
            "mkdir -p /home/agent/.claude && "
            f"echo {shlex.quote(json.dumps(self.settings))} "
            "| tee /home/agent/.claude.json /home/agent/.claude/settings.json > /dev/null && "
            "chown -R agent:agent /home/agent/.claude /home/agent/.claude.json",
            user="root",
            check=True,
            timeout=60,
        )

    def command(self, prompt: str) -> str:
        """The shell command that runs the CLI on `prompt`."""
        return with_extra_args(
            f"{self.binary} -p {shlex.quote(prompt)} {self.launch_flags}", self.extra_args_env
        )

    def environment(self, ctx: HarnessContext) -> dict[str, str]:
        """The CLI's environment: the adapter, the session id as the API token, the model label."""
        env = {
            "ANTHROPIC_BASE_URL": ctx.adapter_url,
            "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
            "ANTHROPIC_MODEL": ctx.model_label,
            **self.static_env,
        }
        env.update(extra_envs(self.extra_envs_env))
        return env

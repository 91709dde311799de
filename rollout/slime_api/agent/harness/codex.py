"""`slime.agent.harness.codex`: OpenAI's Codex CLI as a harness.

Codex talks to the OpenAI adapter's chat endpoint through a custom model provider, `slime`, in
~/.codex/config.toml. Its base URL must be written there: Codex reads the base URL from the
environment only for its built-in OpenAI provider. The key (`OPENAI_API_KEY`, sent as the bearer
token) is the session id the adapter files the turns under. The config goes in base64-encoded,
which no quoting in the TOML can break.

Host settings: SLIME_AGENT_NODE_TARBALL and SLIME_AGENT_CODEX_TARBALL (the tarballs `install_cli`
uploads), SLIME_AGENT_CODEX_EXTRA_ARGS (appended to the command line),
SLIME_AGENT_CODEX_EXTRA_ENVS (a JSON object merged into the environment last).
"""

from __future__ import annotations

import base64
import os
import shlex
from pathlib import Path

from tether.rollout.slime_api.agent.harness.common import (
    CliHarness,
    HarnessContext,
    extra_envs,
    install_npm_cli,
    with_extra_args,
)
from tether.rollout.slime_api.agent.sandbox import Sandbox


class CodexHarness(CliHarness):
    """Codex (`codex exec`) against the OpenAI adapter."""

    name = "codex"

    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"

    exec_flags = "--skip-git-repo-check"
    """Flags after `codex exec`; the git check trips on shallow or foreign-owned checkouts."""

    config_toml = (
        'model = "{model}"\n'
        'model_provider = "slime"\n'
        "\n"
        "[model_providers.slime]\n"
        'name = "slime"\n'
        'base_url = "{base_url}"\n'
        'env_key = "OPENAI_API_KEY"\n'
        'wire_api = "chat"\n'
    )
    """~/.codex/config.toml; `{model}` and `{base_url}` are filled per run."""

    async def install_cli(self, sb: Sandbox) -> None:
        await install_npm_cli(
            sb,
            node_runtime=Path(os.environ[self.node_tarball_env]),
            npm_package=Path(os.environ[self.cli_tarball_env]),
            check_cmd="codex --version",
        )

    def render_config(self, ctx: HarnessContext) -> str:
        """The config.toml for a run: the `slime` provider at the adapter's /v1."""
        return self.config_toml.format(model=ctx.model_label, base_url=f"{ctx.adapter_url}/v1")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        encoded = base64.b64encode(self.render_config(ctx).encode()).decode("ascii")
        await sb.exec(
            "mkdir -p /home/agent/.codex && "
            f"echo {shlex.quote(encoded)} | base64 -d > /home/agent/.codex/config.toml && "
            "chown -R agent:agent /home/agent/.codex",
            user="root",
            check=True,
            timeout=60,
        )

    def command(self, prompt: str) -> str:
        """The shell command that runs the CLI on `prompt`."""
        return with_extra_args(f"codex exec {self.exec_flags} {shlex.quote(prompt)}", self.extra_args_env)

    def environment(self, ctx: HarnessContext) -> dict[str, str]:
        """The CLI's environment: the session id as the API key, the adapter's /v1 as the base URL."""
        env = {"OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1"}
        env.update(extra_envs(self.extra_envs_env))
        return env

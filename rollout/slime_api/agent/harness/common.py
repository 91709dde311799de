"""`slime.agent.harness.common`: the lifecycle every sandboxed coding agent shares.

A harness is one coding-agent CLI. `BaseHarness.run` is the lifecycle: make the unprivileged
`agent` user own the workdir, write the CLI's config, launch the agent and wait for it. A new
CLI subclasses BaseHarness with `install_cli`, `write_config` and `launch_and_wait`; npm-packaged
CLIs install with `install_npm_cli`, and one-shot CLIs launch with `run_agent`, which runs the
command detached (`exec_and_wait`) so an agent session of half an hour needs no open stream.

Harnesses are singletons (`SingletonMeta`): `ClaudeCodeHarness()` is the same object wherever it
is made. They hold no task state; the workspace and the prompt are the caller's.
"""

from __future__ import annotations

import asyncio
import json
import lzma
import os
import shutil
import tempfile
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from tether.rollout.slime_api.agent import sandbox as _sandbox
from tether.rollout.slime_api.agent.sandbox import Sandbox, exec_and_wait
from tether.rollout.slime_api.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3
"""Tries of the in-sandbox global npm install (transient failures such as exit 217 pass); cheaper
than booting the sandbox again."""
NPM_INSTALL_BACKOFF_SEC = 2.0
"""The wait after failed try n is n times this."""
NPM_INSTALL_BUDGET_SEC = 300
NODE_INSTALL_TIMEOUT_SEC = 180


class SingletonABCMeta(ABCMeta, SingletonMeta):
    """Abstract methods and one instance per class, together."""


@dataclass(frozen=True)
class HarnessContext:
    """What a harness run needs, with nothing of the task in it.

    `model_label` is the model name the CLI is told to ask for; the adapter serves whatever the
    engines hold whatever the name, so it is fixed rather than a `run` argument.
    """

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    """A coding agent's lifecycle in a sandbox; subclasses supply the CLI-specific steps."""

    name: str = ""
    """Short identifier (`claude_code`, `codex`)."""

    @abstractmethod
    async def install_cli(self, sb: Sandbox) -> None:
        """Install the CLI into the sandbox (npm-packaged CLIs: `install_npm_cli`)."""

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Write the CLI's configuration files into the sandbox."""

    @abstractmethod
    async def launch_and_wait(
        self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int
    ) -> int:
        """Run the agent on `prompt` to completion; its exit code.

        A one-shot CLI builds its command line and hands it to `run_agent`; an interactive one
        drives its own loop here."""

    async def run(
        self,
        sb: Sandbox,
        *,
        workdir: str,
        session_id: str,
        adapter_url: str,
        time_budget_sec: int,
        prompt: str,
    ) -> int:
        """Run the agent in the sandbox: the agent user, the config, then launch and wait; the
        agent's exit code (EXIT_TIME_BUDGET_EXCEEDED when it ran out of time). The workspace
        (problem statement and the like) must be ready before."""
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


async def run_agent(
    sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int
) -> int:
    """Run `start_cmd` as `agent` in `workdir` with `env`, detached, until it ends or the budget
    runs out; its exit code. Its output goes to `{workdir}/.harness/trajectory.jsonl`."""
    meta_dir = f"{workdir}/.harness"
    await sb.exec(f"mkdir -p {meta_dir} && chown agent:agent {meta_dir}", user="root", check=True, timeout=30)
    exit_code, _ = await exec_and_wait(
        sb,
        cmd=start_cmd,
        user="agent",
        env=env,
        workdir=workdir,
        out_file=f"{meta_dir}/trajectory.jsonl",
        time_budget_sec=time_budget_sec,
        tag="run",
    )
    return exit_code


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path, npm_package: Path, check_cmd: str) -> None:
    """Install Node 22 (`install_node22`), then the CLI's npm tarball globally under /usr/local,
    then run `check_cmd` to see it works; the install is tried NPM_INSTALL_RETRIES times before
    RuntimeError (with the end of the last log)."""
    await install_node22(sb, node_runtime)
    await sb.write_file("/tmp/harness-cli.tgz", npm_package)
    install = f"npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && {check_cmd}"
    exit_code, log = 0, ""
    for attempt in range(1, NPM_INSTALL_RETRIES + 1):
        exit_code, log = await exec_and_wait(
            sb, cmd=install, user="root", time_budget_sec=NPM_INSTALL_BUDGET_SEC, tag="harness-npm-install"
        )
        if exit_code == 0:
            return
        if attempt < NPM_INSTALL_RETRIES:
            await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * attempt)
    raise RuntimeError(
        f"npm install failed after {NPM_INSTALL_RETRIES} attempts (exit={exit_code}):\n{log[-1000:]}"
    )


def _plain_tarball(host_tarball: Path) -> Path:
    """`host_tarball` itself, or for a .xz its decompressed copy (made once per host, in the temp
    directory), so a sandbox without xz-utils can unpack it."""
    if host_tarball.suffix != ".xz":
        return host_tarball
    plain = Path(tempfile.gettempdir()) / f"slime-agent-{host_tarball.stem}"
    if not plain.exists():
        partial = plain.with_name(f"{plain.name}.{os.getpid()}.partial")
        with lzma.open(host_tarball, "rb") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(partial, plain)  # whole or absent: concurrent installs never read half a file
    return plain


async def install_node22(sb: Sandbox, host_tarball: Path) -> None:
    """Unpack a Node 22 tarball from the host into /opt/node22 and link node, npm and npx into
    /usr/local/bin (base images may ship a Node too old for the CLIs)."""
    plain = await asyncio.to_thread(_plain_tarball, Path(host_tarball))
    await sb.write_file("/tmp/node22.tar", plain)
    links = " && ".join(
        f"ln -sf /opt/node22/bin/{tool} /usr/local/bin/{tool}" for tool in ("node", "npm", "npx")
    )
    await sb.exec(
        "set -e && mkdir -p /opt/node22 && tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1 && "
        f"{links} && hash -r 2>/dev/null || true && node --version && npm --version",
        user="root",
        timeout=NODE_INSTALL_TIMEOUT_SEC,
        check=True,
    )


def extra_envs(env_name: str) -> dict[str, str]:
    """The JSON object of extra environment variables in `env_name` ({} when unset)."""
    raw = os.environ.get(env_name, "").strip()
    if not raw:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{env_name} must be a JSON object of environment variables, not {raw[:80]!r}")
    return {str(k): str(v) for k, v in value.items()}


def with_extra_args(cmd: str, env_name: str) -> str:
    """`cmd` with the extra command-line arguments in `env_name` appended, as written."""
    extra = os.environ.get(env_name, "").strip()
    return f"{cmd} {extra}" if extra else cmd


class CliHarness(BaseHarness):
    """A harness whose agent is one non-interactive command run to completion by `run_agent`."""

    @abstractmethod
    def command(self, prompt: str) -> str:
        """The shell command that runs the CLI on `prompt`."""

    @abstractmethod
    def environment(self, ctx: HarnessContext) -> dict[str, str]:
        """The CLI's environment (the adapter's URL, the session id as its key)."""

    async def launch_and_wait(
        self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int
    ) -> int:
        return await run_agent(
            sb,
            workdir=ctx.workdir,
            start_cmd=self.command(prompt),
            env=self.environment(ctx),
            time_budget_sec=time_budget_sec,
        )

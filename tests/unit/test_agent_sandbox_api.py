"""slime.agent's sandbox contract, E2B backend settings, detached runs and harnesses, without a sandbox.

A recording fake stands in for the sandbox: it answers the shell commands `exec_and_wait` issues
the way a real shell would (the spawn lock, the clean-up, the done marker the launcher writes),
so these tests hold for any command layout with the right meaning. The threaded aiohttp runner
is served for real (a thread, no process)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import lzma
import re
import shlex
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from tether.rollout.slime_api.agent import sandbox as sandbox_mod
from tether.rollout.slime_api.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from tether.rollout.slime_api.agent.harness import (
    BaseHarness,
    ClaudeCodeHarness,
    CodexHarness,
    HarnessContext,
)
from tether.rollout.slime_api.agent.harness import common as harness_common
from tether.rollout.slime_api.agent.sandbox import (
    EXIT_TIME_BUDGET_EXCEEDED,
    E2BSandbox,
    LocalSandbox,
    Sandbox,
    ensure_agent_user,
    exec_and_wait,
)

E2B_ENV_NAMES = [
    *E2BSandbox.image_metadata_key_env,
    *E2BSandbox.lifetime_sec_env,
    *E2BSandbox.rpc_retries_env,
    *E2BSandbox.size_env,
    sandbox_mod.BACKEND_ENV,
]
LOCAL_ENV_NAMES = [
    "TETHER_AGENT_SANDBOX_DIR",
    "TETHER_AGENT_SANDBOX_NETWORK",
    "TETHER_AGENT_SANDBOX_PRIVATE_DIRS",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*E2B_ENV_NAMES, "SLIME_AGENT_CC_EXTRA_ARGS", "SLIME_AGENT_CC_EXTRA_ENVS"]:
        monkeypatch.delenv(name, raising=False)
    for name in ["SLIME_AGENT_CODEX_EXTRA_ARGS", "SLIME_AGENT_CODEX_EXTRA_ENVS", *LOCAL_ENV_NAMES]:
        monkeypatch.delenv(name, raising=False)


@dataclasses.dataclass
class Call:
    op: str
    target: str
    user: str
    env: dict[str, str] | None = None


class FakeSandbox:
    """An in-memory sandbox that records every call and plays the detached launch.

    `script(launcher_body, env)` is the command's run: it returns (exit code, output), which land
    in the out file and the done marker the launcher names, as the real launcher would write them.
    Without a script a spawned command never finishes."""

    sandbox_id = "fake"

    def __init__(self, script: Callable[[str, dict[str, str] | None], tuple[int, str]] | None = None) -> None:
        self.script = script
        self.files: dict[str, Any] = {}
        self.dirs: set[str] = set()
        self.calls: list[Call] = []
        self.launches = 0

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def write_file(self, sandbox_path: str, content: Any, *, user: str = "root") -> None:
        self.calls.append(Call("write", sandbox_path, user))
        self.files[sandbox_path] = content

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        self.calls.append(Call("read", sandbox_path, user))
        return str(self.files.get(sandbox_path, ""))

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,  # noqa: ASYNC109  # the Sandbox contract's signature
        check: bool = False,
        idempotent: bool = True,
    ) -> tuple[int, str, str]:
        self.calls.append(Call("exec", cmd, user, env))
        if probe := re.fullmatch(r"test -f (\S+) && cat \1", cmd):
            path = probe.group(1)
            return (0, self.files[path], "") if path in self.files else (1, "", "")
        if tail := re.fullmatch(r"tail -c (\d+) (\S+) 2>/dev/null", cmd):
            return 0, str(self.files.get(tail.group(2), ""))[-int(tail.group(1)) :], ""
        for part in (p.strip() for p in cmd.split(";")):
            words = shlex.split(part.rstrip("&")) if part else []
            if words[:2] in (["rm", "-rf"], ["rm", "-f"]):
                for path in words[2:]:
                    self.files.pop(path, None)
                    self.dirs.discard(path)
            elif words[:1] == ["mkdir"] and "|| exit 0" in part:
                if words[1] in self.dirs:
                    return 0, "", ""  # the spawn lock holds: nothing after it runs
                self.dirs.add(words[1])
            elif words[:2] == ["setsid", "bash"]:
                self._launch(launcher=words[2], out_file=words[words.index(">") + 1], env=env)
        return 0, "", ""

    def _launch(self, *, launcher: str, out_file: str, env: dict[str, str] | None) -> None:
        assert launcher in self.files, "the launcher is written before the spawn"
        self.launches += 1
        if self.script is None:
            return
        body = self.files[launcher]
        code, output = self.script(body, env)
        done = re.search(r"echo \$\? > (\S+)", body)
        assert done is not None, body
        self.files[out_file] = output
        self.files[done.group(1)] = f"{code}\n"

    def execs(self) -> list[str]:
        return [c.target for c in self.calls if c.op == "exec"]


@pytest.fixture
def instant_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_mod, "DONE_MARKER_POLL_SEC", 0.0)


# -- the contract -------------------------------------------------------------------------------


def test_backends_and_fakes_satisfy_the_sandbox_protocol() -> None:
    assert isinstance(FakeSandbox(), Sandbox)
    assert isinstance(LocalSandbox(), Sandbox)
    assert isinstance(E2BSandbox("img"), Sandbox)

    class NoReads:
        sandbox_id = "x"

        async def __aenter__(self) -> NoReads:
            return self

        async def __aexit__(self, *exc: object) -> None: ...

        async def exec(self, cmd: str) -> tuple[int, str, str]:
            return 0, "", ""

    assert not isinstance(NoReads(), Sandbox)


def test_local_sandbox_settings_come_from_arguments_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_DIR", "/scratch/sbx")
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_NETWORK", "none")
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_PRIVATE_DIRS", "/data/:/tmp::/srv")
    sb = LocalSandbox()
    assert (sb.base_dir, sb.network) == (Path("/scratch/sbx"), "none")
    assert sb.private_dirs == ("/tmp", "/var/tmp", "/home", "/root", "/run", "/workspace", "/data", "/srv")
    explicit = LocalSandbox(base_dir="/b", network="host", private_dirs=["/tmp"])
    assert (explicit.base_dir, explicit.network, explicit.private_dirs) == (Path("/b"), "host", ("/tmp",))
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_NETWORK", "bridge")
    with pytest.raises(ValueError, match="'host' or 'none'"):
        LocalSandbox()
    with pytest.raises(ValueError, match="absolute paths below /"):
        LocalSandbox(network="host", private_dirs=["relative"])


# -- E2BSandbox: settings, metadata, retries ----------------------------------------------------


def test_e2b_settings_come_from_arguments_then_current_then_legacy_env_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = E2BSandbox("img")
    assert (defaults.timeout, defaults.rpc_retries, defaults.size, defaults.image_metadata_key) == (
        3600,
        6,
        "md",
        None,
    )

    monkeypatch.setenv("SWE_SANDBOX_IMAGE_METADATA_KEY", "legacy/image")
    monkeypatch.setenv("SWE_SANDBOX_LIFETIME_SEC", "77")
    monkeypatch.setenv("SWE_RPC_RETRIES", "2")
    monkeypatch.setenv("SWE_E2B_SANDBOX_SIZE", "sm")
    legacy = E2BSandbox("img")
    assert (legacy.image_metadata_key, legacy.timeout, legacy.rpc_retries, legacy.size) == (
        "legacy/image",
        77,
        2,
        "sm",
    )

    monkeypatch.setenv("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "image")
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "88")
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_RPC_RETRIES", "3")
    monkeypatch.setenv("SLIME_AGENT_E2B_SANDBOX_SIZE", "lg")
    current = E2BSandbox("img")
    assert (current.image_metadata_key, current.timeout, current.rpc_retries, current.size) == (
        "image",
        88,
        3,
        "lg",
    )

    monkeypatch.setenv("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "   ")  # blank: the legacy name answers
    assert E2BSandbox("img").timeout == 77

    explicit = E2BSandbox("img", timeout=5, image_metadata_key="k", rpc_retries=1, size="xl")
    assert (explicit.timeout, explicit.image_metadata_key, explicit.rpc_retries, explicit.size) == (
        5,
        "k",
        1,
        "xl",
    )


def test_e2b_boot_metadata_puts_the_size_beside_the_image_key() -> None:
    assert E2BSandbox("reg/img:1", image_metadata_key="gw.io/image")._metadata() == {
        "gw.io/image": "reg/img:1",
        "gw.io/size": "md",
    }
    assert E2BSandbox("reg/img:1", image_metadata_key="image", size="sm")._metadata() == {
        "image": "reg/img:1",
        "size": "sm",
    }
    assert E2BSandbox("i", image_metadata_key="image", size="")._metadata() == {"image": "i"}


def _error(name: str, text: str = "boom") -> Exception:
    return type(name, (Exception,), {})(text)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (_error("ReadTimeout"), True),
        (_error("RemoteProtocolError"), True),
        (_error("ConnectError"), True),
        (_error("SandboxException", "502 bad gateway"), True),
        (_error("SandboxException", "sandbox abc does not exist"), False),
        (_error("SandboxException", "sandbox is in STOPPED state"), False),
        (_error("TimeoutException", "Execution timed out"), False),
        (ValueError("bad argument"), False),
    ],
)
def test_transient_rpc_errors_are_told_apart_by_class_name_and_message(
    error: Exception, transient: bool
) -> None:
    assert E2BSandbox._is_transient_rpc_error(error) is transient


class FlakyClient:
    """Stands for e2b's AsyncSandbox: a connection pool to reset, calls that fail as told."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0
        self.pool_resets = 0
        self._transport = SimpleNamespace(pool=SimpleNamespace(aclose=self._reset))

    async def _reset(self) -> None:
        self.pool_resets += 1

    async def call(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def _retrying_sandbox(client: FlakyClient, retries: int = 4) -> E2BSandbox:
    sb = E2BSandbox("img", rpc_retries=retries)
    sb.rpc_backoff_base_sec = 0.0  # no waiting between tries
    sb._sb = client
    return sb


def test_rpc_retry_gets_past_transient_failures_resetting_the_pool_each_time() -> None:
    client = FlakyClient([_error("ReadError"), _error("ConnectTimeout")])
    assert asyncio.run(_retrying_sandbox(client)._rpc_retry("op", client.call)) == "ok"
    assert (client.calls, client.pool_resets) == (3, 2)


def test_rpc_retry_never_replays_a_non_idempotent_call_nor_a_real_error() -> None:
    client = FlakyClient([_error("ReadError")])
    with pytest.raises(Exception, match="boom"):
        asyncio.run(_retrying_sandbox(client)._rpc_retry("spawn", client.call, idempotent=False))
    assert client.calls == 1

    client = FlakyClient([ValueError("bad")])
    with pytest.raises(ValueError):
        asyncio.run(_retrying_sandbox(client)._rpc_retry("op", client.call))
    assert (client.calls, client.pool_resets) == (1, 0)


def test_rpc_retry_gives_up_after_rpc_retries_tries_with_the_last_error() -> None:
    client = FlakyClient([_error("ReadError", f"try {i}") for i in range(5)])
    with pytest.raises(Exception, match="try 2"):
        asyncio.run(_retrying_sandbox(client, retries=3)._rpc_retry("op", client.call))
    assert (client.calls, client.pool_resets) == (3, 2)


def test_entering_e2b_without_the_package_names_it_and_the_local_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "e2b", None)  # `import e2b` raises ImportError
    with pytest.raises(RuntimeError, match=r"`e2b` package.*SLIME_AGENT_SANDBOX_BACKEND=local"):
        asyncio.run(E2BSandbox("img", image_metadata_key="image").__aenter__())


def test_the_backend_switch_makes_e2b_sandbox_a_local_one_seeded_by_a_directory_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert E2BSandbox("img")._local is None
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_BACKEND", "local")
    plain = E2BSandbox("registry/swe:1", timeout=900)
    assert isinstance(plain._local, LocalSandbox)
    assert (plain._local.seed, plain._local.lifetime_sec) == (None, 900)
    assert E2BSandbox(str(tmp_path))._local.seed == tmp_path  # type: ignore[union-attr]
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_BACKEND", "docker")
    with pytest.raises(ValueError, match="'e2b' or 'local'"):
        E2BSandbox("img")


# -- exec_and_wait --------------------------------------------------------------------------------


def test_exec_and_wait_writes_a_launcher_clears_spawns_detached_and_reads_the_marker(
    instant_polls: None,
) -> None:
    seen: dict[str, Any] = {}

    def script(body: str, env: dict[str, str] | None) -> tuple[int, str]:
        seen.update(body=body, env=env)
        return 0, "built\n"

    sb = FakeSandbox(script)
    code, output = asyncio.run(
        exec_and_wait(
            sb, cmd="make -j8", time_budget_sec=60, tag="build", user="agent", env={"A": "1"}, workdir="/w"
        )
    )
    assert (code, output) == (0, "")  # success without want_output: no output fetched
    body = seen["body"]
    assert body.startswith("#!/bin/bash\n")
    assert (
        body.index("cd /w")
        < body.index("export HOME=/home/agent")
        < body.index("make -j8")
        < body.index("echo $?")
    )
    assert seen["env"] == {"A": "1"}
    ops = [(c.op, c.target.split()[0], c.user) for c in sb.calls]
    assert ops[:3] == [
        ("write", "/tmp/.build.sh", "agent"),
        ("exec", "rm", "agent"),
        ("exec", "chmod", "agent"),
    ]
    spawn = sb.execs()[1]
    assert "setsid bash /tmp/.build.sh" in spawn and "> /tmp/.build.out 2>&1 &" in spawn
    assert not any("rm -" in c and "setsid" in c for c in sb.execs()), "clearing is not behind the spawn lock"


def test_exec_and_wait_reruns_a_tag_and_a_replayed_spawn_stays_single(instant_polls: None) -> None:
    outcomes = iter([(3, "first failed"), (0, "second ok")])
    sb = FakeSandbox(lambda body, env: next(outcomes))

    async def twice() -> list[tuple[int, str]]:
        return [
            await exec_and_wait(sb, cmd="npm i", time_budget_sec=60, tag="npm", want_output=True),
            await exec_and_wait(sb, cmd="npm i", time_budget_sec=60, tag="npm", want_output=True),
        ]

    assert asyncio.run(twice()) == [(3, "first failed"), (0, "second ok")]
    assert sb.launches == 2
    spawn = next(c for c in sb.execs() if "setsid" in c)
    asyncio.run(sb.exec(spawn))  # a transport replay of the spawn: the lock swallows it
    assert sb.launches == 2


def test_exec_and_wait_reports_the_tail_of_a_failure_and_a_custom_out_file(instant_polls: None) -> None:
    sb = FakeSandbox(lambda body, env: (2, "x" * 1000 + "the error"))
    code, tail = asyncio.run(
        exec_and_wait(sb, cmd="pytest", time_budget_sec=60, tag="t", out_file="/w/log.txt")
    )
    assert code == 2 and len(tail) == 512 and tail.endswith("the error")
    assert "> /w/log.txt 2>&1" in next(c for c in sb.execs() if "setsid" in c)


def test_exec_and_wait_gives_up_at_the_budget_polling_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    sb = FakeSandbox(script=None)  # the command never finishes
    code, _ = asyncio.run(
        exec_and_wait(sb, cmd="sleep 1000", time_budget_sec=0.05, tag="slow", poll_sec=0.01)
    )  # type: ignore[arg-type]
    assert code == EXIT_TIME_BUDGET_EXCEEDED
    polls = [c for c in sb.execs() if c.startswith("test -f /tmp/.slow.done")]
    assert polls, "the marker was polled while the budget lasted"
    assert (
        asyncio.run(exec_and_wait(FakeSandbox(), cmd="x", time_budget_sec=0, tag="z"))[0]
        == EXIT_TIME_BUDGET_EXCEEDED
    )


def test_ensure_agent_user_creates_agent_owning_home_and_workdir_and_trusts_git() -> None:
    sb = FakeSandbox()
    asyncio.run(ensure_agent_user(sb, "/testbed"))
    (call,) = sb.calls
    assert call.user == "root"
    assert "useradd -m -s /bin/bash agent" in call.target
    assert "chown -R agent:agent /home/agent /testbed" in call.target
    assert "git config --system --add safe.directory '*'" in call.target


# -- harnesses ------------------------------------------------------------------------------------


def _ctx(**overrides: str) -> HarnessContext:
    return HarnessContext(
        **{"workdir": "/testbed", "session_id": "sess-1", "adapter_url": "http://h:18001", **overrides}
    )


def test_harness_context_is_frozen_with_slimes_model_label() -> None:
    ctx = _ctx()
    assert ctx.model_label == "slime-actor"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.workdir = "/elsewhere"  # type: ignore[misc]


def test_harnesses_are_singletons_and_the_base_is_abstract() -> None:
    assert ClaudeCodeHarness() is ClaudeCodeHarness()
    assert CodexHarness() is CodexHarness()
    assert CodexHarness() is not ClaudeCodeHarness()
    assert (ClaudeCodeHarness.name, CodexHarness.name) == ("claude_code", "codex")
    with pytest.raises(TypeError):
        BaseHarness()  # type: ignore[abstract]


def test_claude_code_config_preacknowledges_headless_mode() -> None:
    sb = FakeSandbox()
    asyncio.run(ClaudeCodeHarness().write_config(sb, _ctx()))
    (call,) = sb.calls
    assert call.user == "root"
    json_text = shlex.split(call.target.split("echo ", 1)[1].split(" |", 1)[0])[0]
    assert json.loads(json_text) == {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}
    assert "/home/agent/.claude.json /home/agent/.claude/settings.json" in call.target
    assert "chown -R agent:agent /home/agent/.claude /home/agent/.claude.json" in call.target


def test_claude_code_runs_headless_against_the_adapter_as_agent(
    monkeypatch: pytest.MonkeyPatch, instant_polls: None
) -> None:
    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ARGS", "--disallowedTools WebFetch")
    monkeypatch.setenv(
        "SLIME_AGENT_CC_EXTRA_ENVS", json.dumps({"MAX_THINKING_TOKENS": "1024", "ANTHROPIC_MODEL": "m"})
    )
    seen: dict[str, Any] = {}
    sb = FakeSandbox(lambda body, env: (seen.update(body=body, env=env), (0, ""))[1])
    code = asyncio.run(ClaudeCodeHarness().launch_and_wait(sb, _ctx(session_id="sid-9"), "fix it's bug", 60))
    assert code == 0
    assert "/usr/local/bin/claude -p 'fix it'\"'\"'s bug' --permission-mode bypassPermissions" in seen["body"]
    assert (
        "--output-format stream-json --include-partial-messages --include-hook-events --verbose"
        in seen["body"]
    )
    assert any(line.endswith("--verbose --disallowedTools WebFetch") for line in seen["body"].splitlines())
    assert seen["env"] == {
        "ANTHROPIC_BASE_URL": "http://h:18001",
        "ANTHROPIC_AUTH_TOKEN": "sid-9",
        "ANTHROPIC_MODEL": "m",  # the extra envs come last and win
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "MAX_THINKING_TOKENS": "1024",
    }
    mkdir = sb.calls[0]
    assert (mkdir.user, mkdir.target) == (
        "root",
        "mkdir -p /testbed/.harness && chown agent:agent /testbed/.harness",
    )
    assert all(c.user == "agent" for c in sb.calls[1:])
    assert "> /testbed/.harness/trajectory.jsonl 2>&1" in next(c for c in sb.execs() if "setsid" in c)


def test_codex_config_points_a_slime_provider_at_the_adapter() -> None:
    sb = FakeSandbox()
    asyncio.run(CodexHarness().write_config(sb, _ctx(adapter_url="http://10.0.0.2:18001")))
    (call,) = sb.calls
    encoded = shlex.split(call.target.split("echo ", 1)[1])[0]
    toml = base64.b64decode(encoded).decode()
    assert toml == CodexHarness().render_config(_ctx(adapter_url="http://10.0.0.2:18001"))
    assert 'model = "slime-actor"\nmodel_provider = "slime"\n' in toml
    assert "[model_providers.slime]" in toml
    assert 'base_url = "http://10.0.0.2:18001/v1"' in toml
    assert 'env_key = "OPENAI_API_KEY"' in toml and 'wire_api = "chat"' in toml
    assert "base64 -d > /home/agent/.codex/config.toml" in call.target


def test_codex_runs_codex_exec_with_the_session_as_api_key(instant_polls: None) -> None:
    seen: dict[str, Any] = {}
    sb = FakeSandbox(lambda body, env: (seen.update(body=body, env=env), (7, "no"))[1])
    assert asyncio.run(CodexHarness().launch_and_wait(sb, _ctx(), "do it", 60)) == 7
    assert "codex exec --skip-git-repo-check 'do it'" in seen["body"]
    assert seen["env"] == {"OPENAI_API_KEY": "sess-1", "OPENAI_BASE_URL": "http://h:18001/v1"}


def test_harness_run_makes_the_agent_user_before_config_and_launch(instant_polls: None) -> None:
    sb = FakeSandbox(lambda body, env: (0, ""))
    code = asyncio.run(
        CodexHarness().run(
            sb, workdir="/testbed", session_id="s", adapter_url="http://h:1", time_budget_sec=60, prompt="p"
        )
    )
    assert code == 0
    execs = sb.execs()
    assert "useradd" in execs[0] and ".codex/config.toml" in execs[1]
    assert any("setsid" in c for c in execs[2:])


def test_npm_install_is_retried_in_place_then_fails_with_the_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, instant_polls: None
) -> None:
    monkeypatch.setattr(harness_common, "NPM_INSTALL_BACKOFF_SEC", 0.0)
    node, cli = tmp_path / "node.tar", tmp_path / "cli.tgz"
    node.write_bytes(b"node")
    cli.write_bytes(b"cli")
    outcomes = iter([(217, "flake"), (0, "")])
    sb = FakeSandbox(lambda body, env: next(outcomes))
    asyncio.run(
        harness_common.install_npm_cli(sb, node_runtime=node, npm_package=cli, check_cmd="codex --version")
    )
    assert sb.launches == 2
    assert sb.files["/tmp/node22.tar"] == node and sb.files["/tmp/harness-cli.tgz"] == cli
    node_cmd = next(c for c in sb.execs() if "/opt/node22" in c)
    assert "tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1" in node_cmd
    for tool in ("node", "npm", "npx"):
        assert f"ln -sf /opt/node22/bin/{tool} /usr/local/bin/{tool}" in node_cmd
    install = sb.files["/tmp/.harness-npm-install.sh"]
    assert (
        "npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && codex --version"
        in install
    )

    failing = FakeSandbox(lambda body, env: (1, "E404 not found"))
    with pytest.raises(RuntimeError, match=r"after 3 attempts \(exit=1\)[\s\S]*E404"):
        asyncio.run(
            harness_common.install_npm_cli(failing, node_runtime=node, npm_package=cli, check_cmd="true")
        )
    assert failing.launches == 3


def test_an_xz_node_tarball_is_unpacked_once_on_the_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    packed = tmp_path / "node-v22.1.0-linux-x64.tar.xz"
    packed.write_bytes(lzma.compress(b"tar bytes"))
    sb = FakeSandbox()
    asyncio.run(harness_common.install_node22(sb, packed))
    uploaded = sb.files["/tmp/node22.tar"]
    assert isinstance(uploaded, Path) and uploaded.parent == tmp_path / "cache"
    assert uploaded.read_bytes() == b"tar bytes"
    packed.write_bytes(lzma.compress(b"changed"))  # the cached copy is reused
    asyncio.run(harness_common.install_node22(FakeSandbox(), packed))
    assert uploaded.read_bytes() == b"tar bytes"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [uploaded.name]


# -- the threaded aiohttp runner -------------------------------------------------------------------


def test_run_app_in_thread_serves_on_a_free_port_until_stopped() -> None:
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    app.router.add_get("/hi", hello)
    handle = run_app_in_thread(app, host="127.0.0.1", port=0, thread_name="test-app")
    try:
        assert handle.port > 0 and handle.thread.name == "test-app" and handle.thread.is_alive()
        with urllib.request.urlopen(f"http://127.0.0.1:{handle.port}/hi", timeout=10) as reply:
            assert json.loads(reply.read()) == {"path": "/hi"}
    finally:
        handle.stop()
    assert not handle.thread.is_alive()
    assert handle.loop.is_closed()
    handle.stop()  # twice is fine


def test_run_app_in_thread_raises_what_stopped_it_from_listening() -> None:
    first = run_app_in_thread(web.Application(), host="127.0.0.1", port=0)
    try:
        with pytest.raises(OSError):
            run_app_in_thread(web.Application(), host="127.0.0.1", port=first.port)
    finally:
        first.stop()


def test_filtered_access_logger_keeps_failures_and_slow_requests_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.access")
    access = FilteredAccessLogger(logger, "%s")  # the status only

    def request(method: str) -> Any:
        return SimpleNamespace(method=method)

    def response(status: int) -> Any:
        return SimpleNamespace(status=status)

    with caplog.at_level(logging.INFO, logger="test.access"):
        access.log(request("HEAD"), response(500), 1.0)
        access.log(request("POST"), response(200), 3.0)
        access.log(request("POST"), response(500), 0.1)
        access.log(request("POST"), response(200), FilteredAccessLogger.SLOW_THRESHOLD_SEC + 1)
    assert [r.getMessage() for r in caplog.records] == ["500", "200"]

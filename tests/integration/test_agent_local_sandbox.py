"""tether's LocalSandbox for real: bubblewrap sandboxes on this machine, as slime's agent code uses them.

Root and the agent user, what each may write, the host left untouched, files in and out, exec
timeouts that kill the command's whole tree, output caps, detached runs with a done marker, two
sandboxes that cannot see each other, nothing left behind on exit, an agent reaching an adapter
served on the host's loopback, and `E2BSandbox(image)` running locally under the backend switch.
Needs root and bwrap (bin/setup --sglang installs bubblewrap); skips and says so otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from support.wait import until

from tether.rollout.slime_api.agent import sandbox as sandbox_mod
from tether.rollout.slime_api.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from tether.rollout.slime_api.agent.harness import ClaudeCodeHarness
from tether.rollout.slime_api.agent.local_sandbox import LocalSandboxUnavailable, check_host
from tether.rollout.slime_api.agent.sandbox import (
    E2BSandbox,
    ExecTimeout,
    LocalSandbox,
    ensure_agent_user,
    exec_and_wait,
)


def _unavailable() -> str | None:
    try:
        check_host()
    except LocalSandboxUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(
    _unavailable() is not None, reason=f"LocalSandbox cannot run here: {_unavailable()}"
)


@pytest.fixture(autouse=True)
def plain_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults, whatever this shell exports."""
    for name in [
        "SLIME_AGENT_SANDBOX_BACKEND",
        "TETHER_AGENT_SANDBOX_DIR",
        "TETHER_AGENT_SANDBOX_NETWORK",
        "TETHER_AGENT_SANDBOX_PRIVATE_DIRS",
    ]:
        monkeypatch.delenv(name, raising=False)


WORKDIR = "/testbed" if not os.path.lexists("/testbed") else "/tether-testbed"
"""The task's directory, as SWE images have it: a top-level path the host lacks."""


def _processes_matching(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (zombies have none, so the dead do not count)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry.name))
        except OSError:  # gone while we looked
            continue
    return found


def run(coro_fn: Callable[..., Any], *args: Any) -> Any:
    return asyncio.run(coro_fn(*args))


@asynccontextmanager
async def sandbox(tmp_path: Path, **kwargs: Any) -> AsyncIterator[LocalSandbox]:
    async with LocalSandbox(base_dir=tmp_path / "sandboxes", **kwargs) as sb:
        yield sb


def test_root_and_agent_run_as_different_users_each_writing_only_where_it_may(tmp_path: Path) -> None:
    probe = f"tether-probe-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            assert sb.sandbox_id.startswith("local-")
            assert await sb.exec(f"mkdir -p {WORKDIR} && echo seed > {WORKDIR}/f", check=True)
            await ensure_agent_user(sb, WORKDIR)
            root_id = (await sb.exec("id -u; whoami", check=True))[1].split()
            agent_id = (await sb.exec("id -u; whoami; pwd", user="agent", check=True))[1].split()
            assert root_id == ["0", "root"]
            assert agent_id[1:] == ["agent", "/home/agent"] and agent_id[0] != "0"

            # agent: its home, its workdir, the scratch dirs; not the system, not root's files
            ok = f"touch /home/agent/a {WORKDIR}/a /tmp/a /var/tmp/a /workspace/a /dev/shm/a"
            assert (await sb.exec(ok, user="agent"))[0] == 0
            for path in ("/usr/local/bin/x", "/etc/x", "/opt/x", "/usr/bin/x", "/root/x", "/newdir"):
                code, _, _ = await sb.exec(f"touch {path}", user="agent")
                assert code != 0, f"agent wrote {path}"
            code, _, _ = await sb.exec("echo evil >> /etc/passwd", user="agent")
            assert code != 0
            with pytest.raises(RuntimeError, match=r"write_file /etc/agent\.conf as agent"):
                await sb.write_file("/etc/agent.conf", "x", user="agent")

            # root writes the copy-on-write and private dirs; the host's stay as they were
            await sb.exec(
                f"echo in > /usr/local/bin/{probe} && echo in > /tmp/{probe} && echo in > /etc/{probe} "
                f"&& mkdir -p /opt/{probe}",
                check=True,
            )
            assert (await sb.exec(f"cat /usr/local/bin/{probe}", check=True))[1] == "in\n"
            code, _, _ = await sb.exec("mount -o remount,rw /usr")  # root cannot undo the read-only view
            assert code != 0
            code, _, _ = await sb.exec(f"touch /usr/bin/{probe}")
            assert code != 0

    run(scenario)
    for host_path in (
        f"/usr/local/bin/{probe}",
        f"/tmp/{probe}",
        f"/etc/{probe}",
        f"/opt/{probe}",
        f"/usr/bin/{probe}",
    ):
        assert not os.path.lexists(host_path), f"the sandbox wrote the host's {host_path}"
    assert not os.path.lexists(WORKDIR)


@pytest.mark.skipif(not os.path.isdir("/srv"), reason="the host has no /srv to make private")
def test_a_host_directory_made_private_by_the_environment_is_the_sandboxs_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_PRIVATE_DIRS", "/srv")
    probe = f"tether-probe-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            await sb.write_file(f"/srv/{probe}/repo/README", "mine")
            assert await sb.read_file(f"/srv/{probe}/repo/README") == "mine"
        async with sandbox(tmp_path, private_dirs=["/tmp"]) as plain:
            code, _, _ = await plain.exec(f"mkdir /srv/{probe}")
            assert code != 0, "without it /srv is the host's, read-only"

    run(scenario)
    assert not os.path.lexists(f"/srv/{probe}")


def test_write_and_read_files_as_text_bytes_and_host_files(tmp_path: Path) -> None:
    host_file = tmp_path / "payload.bin"
    payload = bytes(range(256)) * 64
    host_file.write_bytes(payload)

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            await sb.write_file(f"{WORKDIR}/deep/dir/text.md", "héllo\nworld\n")
            assert await sb.read_file(f"{WORKDIR}/deep/dir/text.md") == "héllo\nworld\n"
            await sb.write_file("/tmp/b.txt", b"raw\x00bytes\n")
            assert await sb.read_file("/tmp/b.txt") == "raw\x00bytes\n"
            await sb.write_file("/workspace/payload.bin", host_file)
            _, digest, _ = await sb.exec("sha256sum /workspace/payload.bin | cut -d' ' -f1", check=True)
            assert digest.strip() == hashlib.sha256(payload).hexdigest()
            assert await sb.read_file("/no/such/file") == ""
            await ensure_agent_user(sb, WORKDIR)
            await sb.write_file("/home/agent/notes.txt", "mine", user="agent")
            _, owner, _ = await sb.exec("stat -c %U /home/agent/notes.txt", check=True)
            assert owner.strip() == "agent"
            await sb.exec("echo secret > /root/s && chmod 600 /root/s", check=True)
            assert await sb.read_file("/root/s", user="agent") == ""  # unreadable to agent: ""
            assert await sb.read_file("/root/s") == "secret\n"

    run(scenario)


def test_an_exec_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = f"98{uuid.uuid4().int % 10**6:06d}"

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            with pytest.raises(ExecTimeout) as caught:
                await sb.exec(f"echo started; sleep {marker} & sleep {marker}", timeout=1)
            assert caught.value.stdout == "started\n"
            await until(
                lambda: not _processes_matching(f"sleep\0{marker}"), 5, "the timed-out command's tree is gone"
            )
            assert (await sb.exec("echo alive"))[1] == "alive\n"  # the sandbox itself lives on

    run(scenario)


def test_output_past_the_limit_is_cut_and_the_cut_is_noted(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with sandbox(tmp_path, output_limit_bytes=1000) as sb:
            code, out, err = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a; echo oops >&2")
            assert code == 0 and err == "oops\n"
            assert out.startswith("a" * 1000) and "a" * 1001 not in out
            assert "truncated at 1000 bytes; 4000 more bytes dropped" in out

    run(scenario)


def test_exec_and_wait_runs_a_detached_command_to_its_done_marker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            await sb.exec(f"mkdir -p {WORKDIR}", check=True)
            await ensure_agent_user(sb, WORKDIR)
            code, out = await exec_and_wait(
                sb,
                cmd='echo "$PWD $HOME $(whoami) $GREETING"; echo partial > result; exit 3',
                time_budget_sec=30,
                tag="job",
                user="agent",
                env={"GREETING": "hi"},
                workdir=WORKDIR,
                want_output=True,
                poll_sec=0.05,
            )
            assert (code, out) == (3, f"{WORKDIR} /home/agent agent hi\n")
            assert await sb.read_file(f"{WORKDIR}/result") == "partial\n"
            code, tail = await exec_and_wait(sb, cmd="exit 0", time_budget_sec=30, tag="job", poll_sec=0.05)
            assert (code, tail) == (0, "")
            code, _ = await exec_and_wait(sb, cmd="sleep 30", time_budget_sec=0.3, tag="slow", poll_sec=0.05)  # type: ignore[arg-type]
            assert code == -1

    run(scenario)


def test_two_sandboxes_cannot_see_each_other(tmp_path: Path) -> None:
    marker = f"97{uuid.uuid4().int % 10**6:06d}"

    async def scenario() -> None:
        async with sandbox(tmp_path) as a, sandbox(tmp_path) as b:
            await a.exec(
                f"echo a > /tmp/mine && echo a > /workspace/mine && (setsid sleep {marker} >/dev/null 2>&1 &)"
            )
            assert (await b.exec("cat /tmp/mine /workspace/mine"))[0] != 0
            _, processes, _ = await b.exec("ps -eo args")
            assert marker not in processes
            _, own, _ = await a.exec("ps -eo args")
            assert marker in own
            assert a.dir is not None
            code, _, _ = await b.exec(f"ls {a.dir}")
            assert code != 0, "a sandbox sees the sandboxes' directory"
            assert (await a.exec("hostname"))[1].strip() == a.sandbox_id

    run(scenario)


def test_leaving_the_sandbox_kills_everything_in_it_and_removes_its_directory(tmp_path: Path) -> None:
    marker = f"96{uuid.uuid4().int % 10**6:06d}"

    async def scenario() -> Path:
        async with sandbox(tmp_path) as sb:
            await sb.exec(
                f"(setsid sleep {marker} >/dev/null 2>&1 &); (sleep {marker}1 >/dev/null 2>&1 &)", check=True
            )
            await sb.exec(f"mkdir -p {WORKDIR}/sub && chmod 000 {WORKDIR}/sub", check=True)
            assert len(_processes_matching(marker)) == 2
            assert sb.dir is not None
            return sb.dir

    directory = run(scenario)
    assert _processes_matching(marker) == []
    assert not directory.exists()
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_a_sandbox_ends_with_everything_in_it_when_its_lifetime_runs_out(tmp_path: Path) -> None:
    marker = f"95{uuid.uuid4().int % 10**6:06d}"

    async def scenario() -> None:
        async with sandbox(tmp_path, lifetime_sec=1) as sb:
            await sb.exec(f"(setsid sleep {marker} >/dev/null 2>&1 &)", check=True)
            assert _processes_matching(marker) and not sb.ended
            await until(lambda: sb.ended, 10, "the sandbox ends at its lifetime")
            assert not _processes_matching(marker)
            with pytest.raises(RuntimeError, match="has ended"):
                await sb.exec("true")

    run(scenario)


def test_an_agent_in_the_sandbox_reaches_an_adapter_on_the_hosts_loopback(tmp_path: Path) -> None:
    app = web.Application()

    async def messages(request: web.Request) -> web.Response:
        return web.json_response({"auth": request.headers.get("x-api-key", "")})

    app.router.add_post("/v1/messages", messages)
    handle = run_app_in_thread(
        app, host="127.0.0.1", port=0, runner_kwargs={"access_log_class": FilteredAccessLogger}
    )
    request = (
        f"exec 3<>/dev/tcp/127.0.0.1/{handle.port} && "
        "printf 'POST /v1/messages HTTP/1.0\\r\\nx-api-key: sess-7\\r\\nContent-Length: 0\\r\\n\\r\\n' >&3 && cat <&3"
    )

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            await sb.exec(f"mkdir -p {WORKDIR}", check=True)
            await ensure_agent_user(sb, WORKDIR)
            code, out, err = await sb.exec(request, user="agent", timeout=30)
            assert code == 0, err
            assert out.startswith("HTTP/1.0 200") and out.rstrip().endswith('{"auth": "sess-7"}')
        async with sandbox(tmp_path, network="none") as isolated:
            code, _, _ = await isolated.exec(request, timeout=30)
            assert code != 0, "network='none' still reached the host"

    try:
        run(scenario)
    finally:
        handle.stop()


STUB_CLAUDE = r"""#!/bin/bash
# stands for the claude CLI: one request to the adapter, authenticated with the session's token
hostport=${ANTHROPIC_BASE_URL#http://}
exec 3<>"/dev/tcp/${hostport%:*}/${hostport#*:}"
printf 'POST /v1/messages HTTP/1.0\r\nx-api-key: %s\r\nContent-Length: 0\r\n\r\n' "$ANTHROPIC_AUTH_TOKEN" >&3
cat <&3
echo
echo "ran as $(whoami) in $PWD with: $*"
"""


def test_a_harness_runs_its_agent_as_agent_in_the_workdir_against_a_host_adapter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """slime's coding-agent flow on one machine: ClaudeCodeHarness.run in a LocalSandbox, its CLI
    (a stub here) reaching an adapter served from a thread of this process."""
    monkeypatch.setattr(sandbox_mod, "DONE_MARKER_POLL_SEC", 0.05)
    seen: list[str] = []
    app = web.Application()

    async def messages(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-api-key", ""))
        return web.json_response({"type": "message"})

    app.router.add_post("/v1/messages", messages)
    handle = run_app_in_thread(app, host="127.0.0.1", port=0)

    async def scenario() -> None:
        async with sandbox(tmp_path) as sb:
            await sb.write_file("/usr/local/bin/claude", STUB_CLAUDE)
            await sb.exec(f"chmod 755 /usr/local/bin/claude && mkdir -p {WORKDIR}", check=True)
            code = await ClaudeCodeHarness().run(
                sb,
                workdir=WORKDIR,
                session_id="sess-42",
                adapter_url=f"http://127.0.0.1:{handle.port}",
                time_budget_sec=60,
                prompt="fix the bug",
            )
            assert code == 0
            log = await sb.read_file(f"{WORKDIR}/.harness/trajectory.jsonl")
            assert '{"type": "message"}' in log
            assert (
                f"ran as agent in {WORKDIR} with: -p fix the bug --permission-mode bypassPermissions" in log
            )
            settings = await sb.read_file("/home/agent/.claude/settings.json", user="agent")
            assert '"bypassPermissionsModeAccepted": true' in settings

    try:
        run(scenario)
    finally:
        handle.stop()
    assert seen == ["sess-42"]


def test_e2b_sandbox_under_the_backend_switch_is_a_local_sandbox_seeded_by_the_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    (image / WORKDIR.lstrip("/")).mkdir(parents=True)
    (image / WORKDIR.lstrip("/") / "README.md").write_text("the task's repo\n")
    (image / "etc").mkdir()
    (image / "etc" / "task.conf").write_text("k=v\n")
    monkeypatch.setenv("SLIME_AGENT_SANDBOX_BACKEND", "local")
    monkeypatch.setenv("TETHER_AGENT_SANDBOX_DIR", str(tmp_path / "sandboxes"))

    async def scenario() -> None:
        async with E2BSandbox(str(image), timeout=600) as sb:
            assert sb.sandbox_id.startswith("local-")
            assert await sb.read_file(f"{WORKDIR}/README.md") == "the task's repo\n"
            assert await sb.read_file("/etc/task.conf") == "k=v\n"
            assert (await sb.exec("test -s /etc/passwd"))[0] == 0  # the host's /etc under the seed's file
            await ensure_agent_user(sb, WORKDIR)
            await sb.write_file(f"{WORKDIR}/PROBLEM_STATEMENT.md", "fix it", user="agent")
            _, out, _ = await sb.exec(f"cd {WORKDIR} && ls", user="agent", check=True)
            assert out.split() == ["PROBLEM_STATEMENT.md", "README.md"]
            with pytest.raises(ExecTimeout):
                await sb.exec("sleep 30", timeout=1)

    run(scenario)
    assert not os.path.lexists(WORKDIR)
    assert list((tmp_path / "sandboxes").iterdir()) == []
    with pytest.raises(ValueError, match="read-only /usr"):
        bad = tmp_path / "bad"
        (bad / "usr" / "bin").mkdir(parents=True)
        (bad / "usr" / "bin" / "tool").write_text("x")

        async def seeded() -> None:
            async with E2BSandbox(str(bad)):
                pass

        run(seeded)

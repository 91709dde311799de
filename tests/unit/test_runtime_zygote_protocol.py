"""The zygote's request / exit-report protocol, without a process: messages, what may be forked,
the child's sys.path, and the agent's client driven through a socketpair by a stand-in zygote."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tether.runtime.loop import run
from tether.runtime.process import zygote as z
from tether.runtime.process import zygote_client
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.zygote_client import (
    ZygoteChild,
    ZygoteClient,
    ZygoteUnavailable,
    fork_refusal,
    zygote_environment,
)
from tether.runtime.rpc.secret import SECRET_ENV

PY = [sys.executable, "-m", "pkg.mod"]
BASE = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "HOME": "/root"}


def test_every_message_round_trips_and_requests_are_not_reports() -> None:
    start = z.Start(
        id=3, name="a", module="m", args=["--x", "1"], env_set={"K": "v"}, env_unset=["U"], cwd="/", log="/l"
    )
    assert z.decode_request(z.encode(start)) == start
    assert start.preload == []
    for report in (
        z.Ready(pid=1),
        z.Started(id=3, pid=9),
        z.Refused(id=3, reason="no"),
        z.Exited(pid=9, returncode=-9),
    ):
        assert z.decode_report(z.encode(report)) == report
    with pytest.raises(msgspec.ValidationError):
        z.decode_report(z.encode(start))
    with pytest.raises(msgspec.ValidationError):
        z.decode_request(z.encode(z.Ready(pid=1)))


def test_what_the_zygote_may_fork() -> None:
    assert fork_refusal(PY, BASE, BASE) is None
    assert fork_refusal([*PY, "--flag"], {**BASE, "TETHER_X": "1", "CUDA_VISIBLE_DEVICES": "0"}, BASE) is None
    # PYTHONPATH is rebuilt in the child; PYTHONUNBUFFERED only counts as set or not.
    assert fork_refusal(PY, {**BASE, "PYTHONPATH": "/elsewhere"}, BASE) is None
    assert fork_refusal(PY, {**BASE, "PYTHONUNBUFFERED": "yes"}, BASE) is None
    assert "PYTHONUNBUFFERED" in str(
        fork_refusal(PY, {k: v for k, v in BASE.items() if k != "PYTHONUNBUFFERED"}, BASE)
    )
    for key in (
        "PYTHONHASHSEED", "PYTHONOPTIMIZE", "LD_PRELOAD", "LC_ALL", "LANG", "TZ", "MALLOC_ARENA_MAX",
        # read as a preload's native libraries load (OpenMP, OpenBLAS, MKL, torch)
        "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_AFFINITY", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
        "TORCH_LOGS", "PYTORCH_CUDA_ALLOC_CONF",
    ):  # fmt: skip
        assert key in str(fork_refusal(PY, {**BASE, key: "1"}, BASE))
    assert "is not [sys.executable, '-m'" in str(fork_refusal(["/usr/bin/python3", "-m", "m"], BASE, BASE))
    assert "is not [sys.executable, '-m'" in str(fork_refusal([sys.executable, "-S", "-m", "m"], BASE, BASE))
    assert "is not [sys.executable, '-m'" in str(fork_refusal([sys.executable, "script.py"], BASE, BASE))
    assert "not a module name" in str(fork_refusal([sys.executable, "-m", "a-b"], BASE, BASE))


def test_zygote_environment_holds_no_secret_and_is_unbuffered() -> None:
    env = zygote_environment({"A": "1", SECRET_ENV: "00ff"})
    assert env == {"A": "1", "PYTHONUNBUFFERED": "1"}
    assert zygote_environment({"PYTHONUNBUFFERED": ""})["PYTHONUNBUFFERED"] == ""


def test_spec_fields_are_checked() -> None:
    ok = ProcessSpec(name="a", argv=PY, zygote=True, preload=["tether.bench.runtime.actor_host"])
    ok.validate()
    # Without the run secret: the node's secret-less zygote forks it.
    ProcessSpec(name="a", argv=PY, zygote=True, run_secret=False, preload=["m"]).validate()
    with pytest.raises(ValueError, match="applies only with zygote=True"):
        ProcessSpec(name="a", argv=PY, preload=["m"]).validate()
    with pytest.raises(ValueError, match="not module names"):
        ProcessSpec(name="a", argv=PY, zygote=True, preload=["m", "no/path"]).validate()
    # A spec from an older head (no such fields) decodes with them off.
    old = msgspec.msgpack.decode(msgspec.msgpack.encode({"name": "a", "argv": PY}), type=ProcessSpec)
    assert (old.zygote, old.preload) == (False, [])


def test_child_sys_path_is_what_python_dash_m_builds() -> None:
    # Measured with CPython 3.11: `PYTHONPATH='foo::/x' python -m m` in /tmp/k gives
    # ['/tmp/k', '/tmp/k/foo', '/tmp/k', '/x', <stdlib...>]; '../a/./b:/y/../z/:' gives
    # ['/tmp/k', '/tmp/a/b', '/z', '/tmp/k', ...].
    assert z.pythonpath_entries("foo::/x", "/tmp/k") == ["/tmp/k/foo", "/tmp/k", "/x"]
    assert z.pythonpath_entries("../a/./b:/y/../z/:", "/tmp/k") == ["/tmp/a/b", "/z", "/tmp/k"]
    assert z.pythonpath_entries("", "/tmp/k") == [] and z.pythonpath_entries(None, "/tmp/k") == []
    zygote_path = ["/agent/cwd", "/old/pp", "/stdlib", "/site"]
    assert z.child_sys_path(zygote_path, 1, "/run", "new:/abs") == [
        "/run",
        "/run/new",
        "/abs",
        "/stdlib",
        "/site",
    ]
    assert z.child_sys_path(zygote_path, 1, "/run", None) == ["/run", "/stdlib", "/site"]


def test_exit_status_of_system_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert z.exit_code_of(SystemExit()) == 0
    assert z.exit_code_of(SystemExit(3)) == 3
    assert z.exit_code_of(SystemExit(256 + 7)) == 7
    assert z.exit_code_of(SystemExit("bad input")) == 1
    assert capsys.readouterr().err == "bad input\n"


# -- the agent's client against a stand-in zygote on a socketpair -------------------------------
@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    agent, zyg = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield agent, zyg
    agent.close()
    zyg.close()


class StandIn:
    """The zygote's end: reads requests, sends reports (a pipe's read end stands in for a pidfd:
    it becomes readable when the write end closes, as a pidfd does when its process ends)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pipes: list[int] = []

    async def request(self) -> z.Start:
        loop = asyncio.get_running_loop()
        return z.decode_request(await loop.sock_recv(self.sock, 1 << 16))

    def send(self, report: z.Report, with_fd: bool = False) -> int:
        if not with_fd:
            self.sock.send(z.encode(report))
            return -1
        r, w = os.pipe()
        socket.send_fds(self.sock, [z.encode(report)], [r])
        os.close(r)  # the client holds its own copy now
        self.pipes.append(w)
        return w


def _client() -> ZygoteClient:
    return ZygoteClient(log=Path("/nonexistent/zygote.log"), grace=1.0, environ={**BASE, SECRET_ENV: "ab"})


def test_client_starts_children_and_reports_their_exits(pair: tuple[socket.socket, socket.socket]) -> None:
    agent_end, zygote_end = pair
    zygote_end.setblocking(False)

    async def main() -> None:
        client = _client()
        client._attach(agent_end, 4242)
        zyg = StandIn(zygote_end)
        env = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", SECRET_ENV: "ab", "NEW": "x"}  # HOME dropped
        spawn = asyncio.ensure_future(
            client.spawn(name="a", argv=[*PY, "--n", "1"], env=env, cwd="/w", log="/l/a.log", preload=["m"])
        )
        # Nothing is sent before the zygote is ready.
        await asyncio.sleep(0)
        with pytest.raises(BlockingIOError):
            zygote_end.recv(1 << 16)
        zyg.send(z.Ready(pid=4242))
        req = await zyg.request()
        assert (req.name, req.module, req.args, req.cwd, req.log, req.preload) == (
            "a", "pkg.mod", ["--n", "1"], "/w", "/l/a.log", ["m"]
        )  # fmt: skip
        # The environment travels as the difference from the zygote's own (which has no secret).
        assert req.env_set == {SECRET_ENV: "ab", "NEW": "x"} and req.env_unset == ["HOME"]
        w = zyg.send(z.Started(id=req.id, pid=777), with_fd=True)
        child = await spawn
        assert isinstance(child, ZygoteChild) and child.pid == 777 and child.returncode is None
        # Refused: the caller learns why and spawns instead.
        second = asyncio.ensure_future(client.spawn(name="b", argv=PY, env=env, cwd="/w", log="/l/b.log"))
        req2 = await zyg.request()
        zyg.send(z.Refused(id=req2.id, reason="cwd '/w' is not a directory"))
        with pytest.raises(ZygoteUnavailable, match="the zygote refused: cwd '/w' is not a directory"):
            await second
        # Refused before asking: an interpreter-start variable differs.
        with pytest.raises(ZygoteUnavailable, match="PYTHONHASHSEED"):
            await client.spawn(
                name="c", argv=PY, env={**env, "PYTHONHASHSEED": "1"}, cwd="/w", log="/l/c.log"
            )
        # An exit report ends the child: exit code, or -signal.
        zyg.send(z.Exited(pid=777, returncode=-signal.SIGTERM))
        assert await child.wait() == -signal.SIGTERM and child.reason == ""
        os.close(w)

    run(main())


def test_client_when_the_zygote_dies(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_end, zygote_end = pair
    zygote_end.setblocking(False)

    async def main() -> None:
        client = _client()
        client._attach(agent_end, 4242)
        zyg = StandIn(zygote_end)
        zyg.send(z.Ready(pid=4242))
        env = dict(BASE)
        first = asyncio.ensure_future(client.spawn(name="a", argv=PY, env=env, cwd="/", log="/l"))
        req = await zyg.request()
        w = zyg.send(z.Started(id=req.id, pid=501), with_fd=True)
        child = await first
        # A start whose caller gave up: the child it gets anyway is killed (here the kill fails
        # quietly on the stand-in pidfd) and still tracked until its exit.
        gave_up = asyncio.ensure_future(client.spawn(name="b", argv=PY, env=env, cwd="/", log="/l"))
        req_b = await zyg.request()
        gave_up.cancel()
        w_b = zyg.send(z.Started(id=req_b.id, pid=502), with_fd=True)
        pending = asyncio.ensure_future(client.spawn(name="c", argv=PY, env=env, cwd="/", log="/l"))
        await zyg.request()
        zygote_end.shutdown(socket.SHUT_RDWR)  # the zygote dies: EOF
        with pytest.raises(ZygoteUnavailable, match="the zygote died"):
            await pending
        assert client.failure == "the zygote died"
        # Past its launches, a lost zygote stays lost: the caller spawns.
        client.launches = zygote_client.MAX_LAUNCHES
        with pytest.raises(ZygoteUnavailable, match="the zygote died"):
            await client.spawn(name="d", argv=PY, env=env, cwd="/", log="/l")
        # Before that, the next start launches a new one (here: a new stand-in) and is forked.
        client.launches = 1
        new_agent_end, new_zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        new_zygote_end.setblocking(False)

        async def start_stand_in(self: ZygoteClient) -> None:
            self._attach(new_agent_end, 4343)

        monkeypatch.setattr(ZygoteClient, "_start", start_stand_in)
        again = asyncio.ensure_future(client.spawn(name="d", argv=PY, env=env, cwd="/", log="/l"))
        zyg2 = StandIn(new_zygote_end)
        zyg2.send(z.Ready(pid=4343))
        w_d = zyg2.send(z.Started(id=(await zyg2.request()).id, pid=503), with_fd=True)
        assert (await again).pid == 503 and client.launches == 2 and client.pid == 4343
        # Its children are reported once their pidfds say they are gone, not before.
        await asyncio.sleep(0.05)
        assert child.returncode is None
        os.close(w)
        os.close(w_b)
        assert await child.wait() == -signal.SIGKILL
        # Named after the zygote that died, not the one that replaced it.
        assert child.reason.startswith("the zygote died (pid 4242) before reporting its exit")
        for fd in (w_d, new_agent_end.detach(), new_zygote_end.detach()):
            os.close(fd)

    run(main())


def test_client_gives_up_on_a_late_start(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_end, zygote_end = pair
    zygote_end.setblocking(False)
    monkeypatch.setattr(zygote_client, "START_TIMEOUT", 0.05)

    async def main() -> None:
        client = _client()
        client._attach(agent_end, 4242)
        zyg = StandIn(zygote_end)
        zyg.send(z.Ready(pid=4242))
        with pytest.raises(ZygoteUnavailable, match=r"no answer within 0\.05 s"):
            await client.spawn(name="a", argv=PY, env=dict(BASE), cwd="/", log="/l")
        # Started after all: nobody owns it, so it is killed (the stand-in pidfd cannot be
        # signalled: quietly), and its exit is still taken.
        req = await zyg.request()
        w = zyg.send(z.Started(id=req.id, pid=701), with_fd=True)
        zyg.send(z.Exited(pid=701, returncode=-9))
        # Reports arrive in order: once a later one is in, those two have been handled.
        later = asyncio.ensure_future(client.spawn(name="b", argv=PY, env=dict(BASE), cwd="/", log="/l"))
        zyg.send(z.Refused(id=(await zyg.request()).id, reason="enough"))
        with pytest.raises(ZygoteUnavailable, match="enough"):
            await later
        assert client._pending == {} and client._children == {}
        os.close(w)

    run(main())


def test_client_close_reads_the_last_reports(pair: tuple[socket.socket, socket.socket]) -> None:
    agent_end, zygote_end = pair
    zygote_end.setblocking(False)

    async def main() -> None:
        client = _client()
        client._attach(agent_end, 4242)
        zyg = StandIn(zygote_end)
        zyg.send(z.Ready(pid=4242))
        spawn = asyncio.ensure_future(client.spawn(name="a", argv=PY, env=dict(BASE), cwd="/", log="/l"))
        req = await zyg.request()
        w = zyg.send(z.Started(id=req.id, pid=601), with_fd=True)
        child = await spawn
        # The zygote stops its child, reports it and exits; closing reads that before the EOF.
        zyg.send(z.Exited(pid=601, returncode=3))
        zygote_end.shutdown(socket.SHUT_RDWR)
        async with asyncio.timeout(5):  # unread, the report would leave close() waiting on the child
            await client.close(timeout=1.0)
        assert (child.returncode, child.reason) == (3, "")
        assert client.failure == "the zygote exited"
        os.close(w)

    run(main())


def test_zygote_refuses_what_it_cannot_start(
    pair: tuple[socket.socket, socket.socket],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent_end, zygote_end = pair
    zygote = z.Zygote(zygote_end, grace=1.0)
    threads = [1]
    monkeypatch.setattr(z, "thread_count", lambda: threads[0])
    try:

        def start(**kw: object) -> z.Report:
            args: dict[str, object] = dict(
                id=1, name="a", module="m", args=[], env_set={}, env_unset=[], cwd="/", log="/dev/null"
            )
            args.update(kw)
            zygote._start(z.Start(**args))  # type: ignore[arg-type]
            return z.decode_report(agent_end.recv(1 << 16))

        # What would fail in the child is refused before the fork (the agent then spawns).
        assert start(cwd="/nonexistent/dir") == z.Refused(
            id=1, reason="cwd '/nonexistent/dir' is not a directory this user may enter"
        )
        refused = start(log="/nonexistent/dir/a.log")
        assert isinstance(refused, z.Refused) and "No such file or directory" in refused.reason
        # A preload that cannot be imported is left to the child.
        zygote._preload("no_such_module_for_the_zygote")
        assert "not preloading 'no_such_module_for_the_zygote'" in capsys.readouterr().err
        assert zygote.unsafe == ""
        # Threads, however they came: no fork.
        threads[0] = 3
        assert start(id=4) == z.Refused(
            id=4, reason="the zygote runs 3 threads; a fork of a threaded process is unsafe"
        )
        zygote.unsafe = ""
        # A preload that starts a thread: the zygote forks nothing from then on.
        (tmp_path / "zygote_threading_probe.py").write_text("X = 1\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        threads[0] = 2
        refused = start(id=2, preload=["zygote_threading_probe"])
        assert "zygote_threading_probe" in sys.modules
        assert refused == z.Refused(
            id=2,
            reason="the zygote runs 2 threads since importing 'zygote_threading_probe'; "
            "a fork of a threaded process is unsafe",
        )
        threads[0] = 1
        assert start(id=3) == z.Refused(id=3, reason=zygote.unsafe)
    finally:
        sys.modules.pop("zygote_threading_probe", None)
        os.close(zygote.wake_r)
        os.close(zygote.wake_w)

"""Supervisor, shim and node agents with real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import SUPPORT, support_env

from tether.bench.runtime.actors import start_actor
from tether.runtime.errors import ActorDied, HeartbeatLost, NodeLost
from tether.runtime.loop import run
from tether.runtime.process.spec import ExitInfo, ProcessSpec
from tether.runtime.process.supervisor import Heartbeat, Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env

ENV = support_env()  # actors import support.runtime_actors
HEAD = SUPPORT / "runtime_actors.py"  # `python HEAD head RUN_DIR`: a small head process
FAST = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    deadline = time.monotonic() + deadline_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling other processes' state, with a deadline
    return left


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts itself; killed by pid at the end if still running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_actor_calls_exit_reports_and_killed_actor(tmp_path: Path) -> None:
    exits: list[ExitInfo] = []
    b_socket = tmp_path.absolute() / "sock" / "b.ipc"

    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=2.0, heartbeat=FAST, on_exit=exits.append) as sup:
            a, b = await asyncio.gather(
                start_actor(sup, "a", "support.runtime_actors:Echo", {"tag": "A"}, env=ENV, transport="tcp"),
                start_actor(sup, "b", "support.runtime_actors:Echo", {"tag": "B"}, env=ENV),
            )
            assert (await a.whoami())["tag"] == "A" and (await b.whoami())["tag"] == "B"
            # On the head's own node an actor serves on a Unix socket unless tcp is asked for.
            assert a.address.startswith("tcp://127.0.0.1:")
            assert b.address == f"ipc://{b_socket}"
            # A crash reaches the caller of a pending call, the owner and wait(), with the log tail.
            with pytest.raises(ActorDied, match=r"(?s)actor 'a' exited with code 7.*crashing on purpose"):
                await a.crash(7)
            info = await sup.process("a").wait()
            assert info.returncode == 7 and "crashing on purpose with code 7" in info.log_tail
            with pytest.raises(ActorDied, match="actor 'a' exited with code 7"):
                await sup.watch()
            # SIGKILL from outside: a call in flight fails naming the actor, it does not hang.
            pid = (await b.whoami())["pid"]

            async def sleep_until_killed() -> None:
                with pytest.raises(ActorDied, match="actor 'b' killed by SIGKILL"):
                    await b.sleep(600)

            async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
                tg.create_task(sleep_until_killed())
                await b.echo(1)  # the sleep call is in flight before the kill
                os.kill(pid, signal.SIGKILL)
            info = await sup.process("b").wait()
            assert info.signal == signal.SIGKILL
            # A process that dies before it is ready: the start raises with its log tail.
            with pytest.raises(ActorDied, match=r"(?s)broken.*this actor cannot be built"):
                await start_actor(sup, "broken", "support.runtime_actors:Broken", env=ENV)

            # A command that never becomes ready is stopped after ready_timeout.
            async def never() -> bool:
                return False

            with pytest.raises(ActorDied, match=r"not ready within 0\.5 s"):
                await sup.start(
                    ProcessSpec(name="lazy", argv=["sleep", "60"]), ready=never, ready_timeout=0.5
                )
            assert (tmp_path / "logs" / "a.log").exists()

    run(main())
    assert [e.name for e in exits] == ["a", "b", "broken"]


def test_hung_actor_is_reported_by_heartbeat(tmp_path: Path) -> None:
    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=1.0, heartbeat=FAST) as sup:
            h = await start_actor(sup, "hung", "support.runtime_actors:Echo", env=ENV)
            pid = (await h.whoami())["pid"]
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(HeartbeatLost, match=r"actor 'hung'.*no answer within 0\.6 s"):
                    async with asyncio.timeout(10):
                        await sup.watch()
                # interval + timeout, plus scheduling slack on a busy 2-core machine
                assert time.monotonic() - started < FAST.interval + FAST.timeout + 1.5
            finally:
                os.kill(pid, signal.SIGCONT)

    run(main())


def test_head_killed_by_sigkill_takes_its_children(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    head = subprocess.Popen(
        [sys.executable, str(HEAD), "head", str(tmp_path)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    started.append(head)
    assert head.stdout is not None
    pids = json.loads(head.stdout.readline())
    children = [pids["actor_shim"], pids["actor"], pids["sleeper_shim"], *pids["sleeper"]]
    assert len(children) == 4 and all(alive(p) for p in children)
    os.kill(head.pid, signal.SIGKILL)
    head.wait(10)
    assert wait_gone(children, 10.0) == []


def test_sigterm_runs_checkpoint_then_stops_children(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    notify = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(notify)
        listener.settimeout(30)
        head = subprocess.Popen(
            [sys.executable, str(HEAD), "head", str(tmp_path)],
            stdout=subprocess.PIPE,
            env={**os.environ, "NOTIFY_SOCKET": notify},
            start_new_session=True,
        )
        started.append(head)
        assert head.stdout is not None
        pids = json.loads(head.stdout.readline())
        assert listener.recv(4096) == b"READY=1"
        assert listener.recv(4096) == b"STATUS=running"
        os.kill(head.pid, signal.SIGUSR1)  # checkpoint, keep running
        ckpt = tmp_path / "checkpoints.txt"
        deadline = time.monotonic() + 10
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert head.poll() is None
        os.kill(head.pid, signal.SIGTERM)
        assert head.wait(30) == 0
        assert listener.recv(4096) == b"STOPPING=1"
    assert ckpt.read_text() == "checkpoint\ncheckpoint\n"
    assert wait_gone([pids["actor"], pids["actor_shim"], pids["sleeper_shim"], *pids["sleeper"]], 5.0) == []


def spawn_agent(
    head: str, node: str, env: dict[str, str], stderr: int | None = None
) -> subprocess.Popen[bytes]:
    """`tether agent` for `node` (the `started` fixture kills it by pid)."""
    argv = [sys.executable, "-m", "tether.runtime.process.agent", "--head", head, "--node-name", node]
    return subprocess.Popen(argv, env=env, start_new_session=True, stderr=stderr)


async def agent_up(sup: Supervisor, secret: bytes, started: list[subprocess.Popen[bytes]]) -> None:
    """Node n1's agent started and registered."""
    started.append(spawn_agent(sup.address, "n1", {**os.environ, SECRET_ENV: secret_to_env(secret)}))
    await sup.wait_for_node("n1")


def test_two_agents_as_two_nodes(tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    secret = new_secret()

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=FAST) as sup:
            env = {**os.environ, SECRET_ENV: secret_to_env(secret)}
            for node in ("n1", "n2"):
                argv = [
                    sys.executable,
                    "-m",
                    "tether.runtime.process.agent",
                    "--head",
                    sup.address,
                    "--node-name",
                    node,
                ]
                started.append(subprocess.Popen(argv, env=env, start_new_session=True))  # noqa: ASYNC220  # fixture kills by pid
            await sup.wait_for_agents(["n1", "n2"], timeout=30)
            assert set(sup.nodes) == {"local", "n1", "n2"}
            assert sup.nodes["n1"]["address"] == "127.0.0.1"
            h1, h2 = await asyncio.gather(
                start_actor(sup, "on1", "support.runtime_actors:Echo", env=ENV, node="n1"),
                start_actor(sup, "on2", "support.runtime_actors:Echo", env=ENV, node="n2"),
            )
            who1, who2 = await h1.whoami(), await h2.whoami()
            assert (who1["node"], who2["node"]) == ("n1", "n2")
            # An exit on a remote node reaches the head with its code.
            p = await sup.start(ProcessSpec(name="short", argv=["sh", "-c", "echo bye; exit 5"], node="n2"))
            info = await p.wait()
            assert (info.node, info.returncode, info.log_tail) == ("n2", 5, "bye")
            with pytest.raises(ActorDied, match="'short' exited with code 5"):
                await sup.watch()
            # Kill agent n1: the head notices by heartbeat, and n1's actor dies with its agent.
            started[0].kill()
            with pytest.raises(ActorDied, match="actor 'on1' is unreachable \\(node agent lost"):
                async with asyncio.timeout(10):
                    await sup.watch()
            assert wait_gone([who1["pid"]], 10.0) == []
            assert sup.node_states()["n1"]["state"] == "lost"
            with pytest.raises(NodeLost, match="node 'n1' is lost"):
                await sup.start(ProcessSpec(name="x", argv=["true"], node="n1"))
            # A new agent under the same name: the node is back, and runs processes again.
            started.append(spawn_agent(sup.address, "n1", env))
            async with asyncio.timeout(30):
                await sup.wait_for_node("n1")
            assert sup.node_states()["n1"]["state"] == "up"
            p = await sup.start(ProcessSpec(name="x", argv=["sh", "-c", "exit 0"], node="n1"))
            assert (await p.wait()).returncode == 0
            # While n1's agent answers, another agent may not take its name.
            started.append(spawn_agent(sup.address, "n1", env, stderr=subprocess.PIPE))
            assert await asyncio.to_thread(started[3].wait, 30) != 0
            assert started[3].stderr is not None
            assert "node name 'n1' is already taken" in started[3].stderr.read().decode()
            await sup.stop("on2")
        # Leaving the supervisor shuts the remaining agents down.
        assert started[1].wait(15) == 0 and started[2].wait(15) == 0
        evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        nodes = [(e["event"], e["node"]) for e in evs if e["event"] in ("node_lost", "node_joined")]
        assert nodes == [("node_lost", "n1"), ("node_joined", "n1")]
        assert next(e for e in evs if e["event"] == "node_lost")["processes"] == ["on1"]

    run(main())


@pytest.mark.parametrize("misses", [1, 3])
def test_a_stalled_head_keeps_its_agents_within_the_missed_heartbeats(
    misses: int, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """The head's event loop blocks for longer than one heartbeat's interval + timeout (as a
    synchronous tokenizer load once did): with 3 misses allowed the agent stays and serves; with
    1 it gives the head up and (with --rejoin-timeout 0) exits 3, saying how long it waited."""
    secret = new_secret()
    hb = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3, misses=misses)

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=hb) as sup:
            env = {**os.environ, SECRET_ENV: secret_to_env(secret)}
            argv = [
                sys.executable,
                "-m",
                "tether.runtime.process.agent",
                "--head",
                sup.address,
                "--node-name",
                "n1",
                "--rejoin-timeout",
                "0",
            ]
            started.append(subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE))  # noqa: ASYNC220  # fixture kills by pid
            await sup.wait_for_agents(["n1"], timeout=30)
            await asyncio.sleep(hb.first_wait + hb.interval)  # the agent's heartbeats are running
            time.sleep(1.2)  # noqa: ASYNC251  # the fault under test: the head's loop stalls
            if misses == 1:
                assert started[0].wait(15) == 3
                return
            p = await sup.start(ProcessSpec(name="after", argv=["sh", "-c", "exit 0"], node="n1"))
            assert (await p.wait()).returncode == 0
            assert started[0].poll() is None

    run(main())
    if misses == 1:
        assert started[0].stderr is not None
        said = started[0].stderr.read().decode()
        assert "heartbeat(s) in a row missed, no answer for" in said


def test_an_agent_that_gave_a_stalled_head_up_registers_again(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """With 1 miss allowed and the default --rejoin-timeout, an agent gives a head that stalls
    up, stops its processes and registers again once the head answers, naming its last
    registration: the head takes it back (whether or not it had dropped it meanwhile)."""
    secret = new_secret()
    hb = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3, misses=1)

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=hb) as sup:
            await agent_up(sup, secret, started)
            old = await sup.start(
                ProcessSpec(name="sleeper", argv=["sleep", "600"], node="n1"), restartable=True
            )
            await asyncio.sleep(hb.first_wait + hb.interval)  # the agent's heartbeats are running
            time.sleep(1.5)  # noqa: ASYNC251  # the fault under test: the head's loop stalls
            assert (await old.wait()).reason.startswith("node agent lost")
            async with asyncio.timeout(30):
                await sup.wait_for_node("n1")
            assert wait_gone([old.pid], 10.0) == []
            assert started[0].poll() is None

    run(main())
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    nodes = [(e["event"], e["node"]) for e in evs if e["event"] in ("node_lost", "node_joined")]
    assert nodes == [("node_lost", "n1"), ("node_joined", "n1")]


def test_a_frozen_agent_dropped_by_the_head_stops_its_processes_and_registers_again(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """An agent SIGSTOPped past the heartbeat tolerance is lost to the head; SIGCONTed, it learns
    from its next heartbeat that it was dropped, stops the processes the head wrote off, and
    registers again under its name: the node is back and runs processes."""
    secret = new_secret()

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=FAST) as sup:
            await agent_up(sup, secret, started)
            old = await sup.start(
                ProcessSpec(name="sleeper", argv=["sleep", "600"], node="n1"), restartable=True
            )
            os.kill(started[0].pid, signal.SIGSTOP)
            try:
                assert (await old.wait()).reason.startswith("node agent lost")
            finally:
                os.kill(started[0].pid, signal.SIGCONT)
            async with asyncio.timeout(30):
                await sup.wait_for_node("n1")
            assert wait_gone([old.pid], 10.0) == []  # the old process, stopped by its own agent
            new = await sup.start(ProcessSpec(name="sleeper", argv=["sh", "-c", "exit 0"], node="n1"))
            assert (await new.wait()).returncode == 0
            assert started[0].poll() is None  # the same agent, registered again

    run(main())
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    nodes = [(e["event"], e["node"]) for e in evs if e["event"] in ("node_lost", "node_joined")]
    assert nodes == [("node_lost", "n1"), ("node_joined", "n1")]


def test_node_loss_asks_the_agent_then_waits_for_the_heartbeats_verdict(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """`node_loss` (asked by an owner whose call just failed): None at once while the node's
    agent answers; for a frozen agent, the loss's reason as soon as the heartbeats count it lost."""
    secret = new_secret()

    async def main() -> None:
        async with Supervisor(tmp_path, secret, grace=1.0, heartbeat=FAST) as sup:
            await agent_up(sup, secret, started)
            async with asyncio.timeout(FAST.timeout):  # one ping answered, no verdict awaited
                assert await sup.node_loss("n1") is None
                assert await sup.node_loss("local") is None
            os.kill(started[0].pid, signal.SIGSTOP)
            try:
                async with asyncio.timeout(FAST.tolerance + FAST.first_wait + 2.0):
                    reason = await sup.node_loss("n1")
            finally:
                os.kill(started[0].pid, signal.SIGCONT)
            assert reason is not None and "heartbeat" in reason, reason
            assert sup.node_states()["n1"] == {"state": "lost", "reason": reason}

    run(main())


def test_same_node_actor_falls_back_to_tcp_when_the_socket_path_is_too_long(tmp_path: Path) -> None:
    from tether.runtime.rpc.endpoints import ipc_endpoint

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert ipc_endpoint(deep / "sock", "actor") is None
    assert ipc_endpoint(Path("/tmp/r/sock"), "actor") == "ipc:///tmp/r/sock/actor.ipc"

    async def main() -> None:
        async with Supervisor(deep, new_secret(), grace=2.0, heartbeat=FAST) as sup:
            with pytest.raises(ValueError, match="too long a path for a Unix socket"):
                await start_actor(
                    sup, "x", "support.runtime_actors:Echo", {"tag": "X"}, env=ENV, transport="ipc"
                )
            a = await start_actor(sup, "a", "support.runtime_actors:Echo", {"tag": "A"}, env=ENV)
            assert a.address.startswith("tcp://127.0.0.1:")
            assert (await a.whoami())["tag"] == "A"

    run(main())


@pytest.mark.parametrize(
    ("poll_max", "waits"),
    [(None, [0.01, 0.02, 0.04, 0.08, 0.1, 0.1, 0.1]), (0.01, [0.01] * 7)],
)
def test_readiness_is_asked_again_at_most_ready_poll_max_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, poll_max: float | None, waits: list[float]
) -> None:
    """A starting process's `ready()` is asked again after 10 ms, then twice as long each time,
    up to 0.1 s, or up to `ready_poll_max` (the trainer's rank-address files: 10 ms)."""
    asked: list[float] = []
    real_wait = asyncio.wait

    async def recording_wait(fs: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:  # noqa: ASYNC109  # asyncio.wait's own signature
        if timeout is not None:
            asked.append(timeout)
        return await real_wait(fs, timeout=timeout, **kwargs)

    async def main() -> None:
        calls = 0

        async def ready() -> bool:
            nonlocal calls
            calls += 1
            return calls > len(waits)

        async with Supervisor(tmp_path, new_secret(), grace=1.0) as sup:
            monkeypatch.setattr(asyncio, "wait", recording_wait)
            spec = ProcessSpec(name="sleeper", argv=["sleep", "60"])
            extra = {} if poll_max is None else {"ready_poll_max": poll_max}
            await sup.start(spec, ready=ready, ready_timeout=30, **extra)
            monkeypatch.setattr(asyncio, "wait", real_wait)
            await sup.stop("sleeper", grace=1.0)

    run(main())
    assert asked == waits

"""Processes forked from the zygote (ProcessSpec.zygote) behave as spawned ones: one supervisor,
real processes, each case compared with a spawn of the same command or checked against it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from support import TESTS, support_env

from tether.bench.runtime.actors import start_actor
from tether.runtime.errors import ActorDied
from tether.runtime.loop import run
from tether.runtime.process.spec import ExitInfo, ProcessSpec
from tether.runtime.process.supervisor import Supervisor, local_log_tail
from tether.runtime.rpc.secret import new_secret

CHILD = [sys.executable, "-m", "support.zygote_children"]
# What differs between any two processes (ids, own log): left out of the comparison.
_PER_PROCESS = ("pid", "ppid", "pgid", "sid", "stdout", "stderr", "gc_frozen")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_zygote_children_match_spawned_ones(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tether.runtime")
    env = {**support_env(), "ZYGOTE_TEST": "forked?"}
    work = tmp_path / "work"
    work.mkdir()

    def spec(
        name: str, *args: str, zygote: bool = True, extra_env: dict[str, str] | None = None
    ) -> ProcessSpec:
        argv = [*CHILD, *args]
        return ProcessSpec(
            name=name, argv=argv, env={**env, **(extra_env or {})}, cwd=str(work), zygote=zygote
        )

    def says(name: str, word: str) -> Callable[[], Awaitable[bool]]:
        async def ready() -> bool:
            return word in local_log_tail(tmp_path, name)

        return ready

    async def ended(sup: Supervisor, s: ProcessSpec) -> ExitInfo:
        return await (await sup.start(s, restartable=True)).wait()  # restartable: not a failure of the run

    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=1.0) as sup:
            assert sup._local is not None and sup._local.zygote is None  # launched at first use
            os.environ["DROPPED"] = "1"  # in the zygote's environment, gone from the agent's below
            try:
                assert (await ended(sup, spec("first", "describe", "0"))).returncode == 0
            finally:
                del os.environ["DROPPED"]
            assert sup._local.zygote is not None
            zygote = sup._local.zygote
            # The same command, forked and spawned: same argv, cwd, sys.path (PYTHONPATH rebuilt),
            # environment, signal dispositions, stdio, __main__; its own session; exit code kept.
            forked = await ended(sup, spec("forked", "describe", "5"))
            spawned = await ended(sup, spec("spawned", "describe", "5", zygote=False))
            assert (forked.returncode, spawned.returncode) == (5, 5)
            f, s = json.loads(forked.log_tail), json.loads(spawned.log_tail)
            assert f["ppid"] == zygote.pid and f["pid"] == forked.pid  # no shim in between
            # ps shows the command, not the zygote's (and below: the same as the spawned one's)
            assert f["cmdline"] == [*CHILD, "describe", "5"]
            assert f["sid"] == f["pgid"] == f["pid"]
            assert f["stdout"] == f["stderr"] == str(tmp_path / "logs" / "forked.log")
            assert f["env"]["TETHER_PROCESS_NAME"] == "forked" and f["env"]["DROPPED"] is None and f["secret"]
            assert f["cwd"] == str(tmp_path / "work") and f["path"][1] == str(TESTS)
            # The collector is on in both; a forked child's collections skip the zygote's imports.
            assert f["gc_enabled"] and f["gc_frozen"] > 10_000 and s["gc_frozen"] == 0
            same = {k: v for k, v in f.items() if k not in _PER_PROCESS}
            same["env"] = {**f["env"], "TETHER_PROCESS_NAME": "spawned"}
            assert same == {k: v for k, v in s.items() if k not in _PER_PROCESS}

            # An uncaught exception: exit code 1 and the traceback in the log tail.
            info = await ended(sup, spec("raises", "raise"))
            assert info.returncode == 1 and "RuntimeError: raised on purpose" in info.log_tail
            # Death by a signal, from itself or from an uncaught KeyboardInterrupt (as python does).
            info = await ended(sup, spec("usr1", "kill", str(int(signal.SIGUSR1))))
            assert (info.returncode, info.signal) == (None, signal.SIGUSR1)
            info = await ended(sup, spec("interrupted", "interrupt"))
            assert info.signal == signal.SIGINT and "KeyboardInterrupt" in info.log_tail
            # An interpreter-start variable the zygote cannot take: spawned (under the shim), and why.
            odd = await ended(sup, spec("hashseed", "describe", "0", extra_env={"PYTHONHASHSEED": "7"}))
            assert json.loads(odd.log_tail)["ppid"] == odd.pid != zygote.pid
            assert (
                "'hashseed': not forked from the zygote (its environment sets PYTHONHASHSEED" in caplog.text
            )

            # Stop with grace: SIGTERM ignored, so SIGKILL after the grace period; honoured: exit 0.
            await sup.start(
                spec("stubborn", "stubborn"), ready=says("stubborn", "stubborn ready"), ready_timeout=10
            )
            await sup.start(spec("polite", "polite"), ready=says("polite", "polite ready"), ready_timeout=10)
            t = time.monotonic()
            info = await sup.stop("stubborn", grace=0.5)
            assert info.signal == signal.SIGKILL and time.monotonic() - t >= 0.5
            assert (await sup.stop("polite")).returncode == 0

            # An actor through start_actor is forked too, and serves.
            actor = await start_actor(
                sup, "echo", "support.runtime_actors:Echo", {"tag": "z"}, env=support_env()
            )
            who = await actor.whoami()
            assert who["pid"] == sup.process("echo").pid and who["tag"] == "z"

            # Killing the zygote takes its children (PR_SET_PDEATHSIG); each exit is reported.
            await sup.start(spec("orphan", "polite"), ready=says("orphan", "polite ready"), ready_timeout=10)
            orphan = sup.process("orphan").pid
            os.kill(zygote.pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                lost = [await sup.process(n).wait() for n in ("echo", "orphan")]
            assert all(i.signal == signal.SIGKILL and "the zygote died" in i.reason for i in lost)
            assert not _alive(orphan) and not _alive(who["pid"])
            for _ in lost:
                with pytest.raises(ActorDied, match=r"killed by SIGKILL \(the zygote died"):
                    await sup.watch()
            # The next such start launches a new zygote, which forks it.
            dead = zygote.pid
            after = await ended(sup, spec("after", "describe", "0"))
            assert json.loads(after.log_tail)["ppid"] == zygote.pid != dead
            assert "starting a new zygote (the zygote died; launch 2 of 3)" in caplog.text

    try:
        run(main())
    finally:
        os.environ.pop("DROPPED", None)

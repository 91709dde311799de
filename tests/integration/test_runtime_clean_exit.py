"""Clean exits look clean; only real failures leave an error file.

- `Supervisor.stop_gracefully` asks processes to exit, signals only the ones that do not, and
  records every exit (code, expected, how it was stopped) in events.jsonl.
- `tether run` stopped by SIGTERM (checkpoint, then stop) exits 0; its trainer ranks exit by
  themselves when the head asks, so torchrun exits 0 and leaves no error file in logs/.
  (Runs that end normally are checked the same way by every run of test_e2e_run.py.)
- A rank that raises leaves its exception and traceback in logs/trainer-node0-error.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from support import support_env

from tether.bench.runtime.actors import start_actor
from tether.runtime.loop import run
from tether.runtime.process.spec import ExitInfo, ProcessSpec
from tether.runtime.process.supervisor import Heartbeat, Supervisor
from tether.runtime.rpc.secret import new_secret

if TYPE_CHECKING:  # support.e2e (the tiny model) is imported by the end-to-end tests only
    from support.e2e import Workspace

ENV = support_env()  # the actors (Polite, Stubborn) are in support.runtime_actors
FAST = Heartbeat(interval=0.3, timeout=0.6, first_wait=0.3)


def exit_records(run_dir: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {r["name"]: r for r in records if r["event"] == "process_exit"}


def test_stop_gracefully_asks_then_signals_and_records_every_exit(tmp_path: Path) -> None:
    unexpected: list[ExitInfo] = []

    async def main() -> None:
        async with Supervisor(
            tmp_path, new_secret(), grace=5.0, heartbeat=FAST, on_exit=unexpected.append
        ) as sup:
            polite = await start_actor(sup, "polite", "support.runtime_actors:Polite", env=ENV)
            stubborn = await start_actor(sup, "stubborn", "support.runtime_actors:Stubborn", env=ENV)

            async def ask() -> None:
                # The polite one may drop its connection before it answers: that is fine too.
                await asyncio.gather(
                    polite.exit(timeout=10), stubborn.exit(timeout=10), return_exceptions=True
                )

            started = time.monotonic()
            first, second = await sup.stop_gracefully(["polite", "stubborn"], ask, timeout=1.5)
            # The stubborn one waited out the grace before its SIGTERM (the actor host exits 0 on it).
            assert time.monotonic() - started >= 1.5
            assert (first.returncode, first.signal) == (0, None)
            assert (second.returncode, second.signal) == (0, None)
            assert not sup.process("polite").running and not sup.process("stubborn").running

    run(main())
    assert unexpected == []  # asked-for exits are never reported as failures
    records = exit_records(tmp_path)
    assert records["polite"]["stopped_by"] == "request" and records["polite"]["expected"] is True
    assert records["stubborn"]["stopped_by"] == "signal" and records["stubborn"]["expected"] is True
    assert records["polite"]["returncode"] == 0 and records["polite"]["signal"] is None


PARENT = """
import signal, subprocess, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGCHLD])
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
if signal.sigwait([signal.SIGTERM, signal.SIGCHLD]) == signal.SIGCHLD:
    sys.exit(3)  # the worker died under this process: what a server reports as a crash
worker.send_signal(signal.SIGRTMIN)  # a server ends its workers its own way
sys.exit(0 if worker.wait() == 0 else 5)
"""

CHILD = """
import pathlib, signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGCHLD])

def on_term(signum, frame):
    pathlib.Path(sys.argv[1]).write_text("SIGTERM reached the worker under its parent")
    sys.exit(4)

signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGRTMIN, lambda signum, frame: sys.exit(0))
print("worker ready", flush=True)
while True:
    signal.pause()
"""


def test_stop_signals_the_command_which_stops_its_own_children(tmp_path: Path) -> None:
    """SIGTERM goes to the command alone (SGLang's server, torchrun): its workers are its to
    stop. Signalled directly, they would die under it, and it would report them crashed."""
    mark = tmp_path / "worker-got-sigterm"
    log = tmp_path / "logs" / "server.log"

    async def main() -> ExitInfo:
        async with Supervisor(tmp_path, new_secret(), grace=5.0, heartbeat=FAST) as sup:

            async def worker_ready() -> bool:
                return log.exists() and "worker ready" in log.read_text()

            argv = [sys.executable, "-c", PARENT, CHILD, str(mark)]
            await sup.start(ProcessSpec(name="server", argv=argv), ready=worker_ready, ready_timeout=30)
            return await sup.stop("server")

    info = run(main())
    assert (info.returncode, info.signal) == (0, None), info.log_tail
    assert not mark.exists(), mark.read_text()
    assert exit_records(tmp_path)["server"]["stopped_by"] == "signal"


def test_unexpected_exit_is_recorded_as_such(tmp_path: Path) -> None:
    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=1.0, heartbeat=FAST) as sup:
            proc = await sup.start(ProcessSpec(name="short", argv=["sh", "-c", "exit 3"]))
            assert (await proc.wait()).returncode == 3

    run(main())
    record = exit_records(tmp_path)["short"]
    assert (record["returncode"], record["expected"], record["stopped_by"]) == (3, False, None)


# ----- `tether run` end to end -----------------------------------------------------------------


def test_run_stopped_by_sigterm_exits_0_without_error_file(
    ws: Workspace, tmp_path: Path, run_dir: Path
) -> None:
    from support.e2e import check_clean_exit, jsonl

    flags = ws.flags(run_dir, "--num-rollout", "200", "--save", str(tmp_path / "ckpt"))
    with open(tmp_path / "tether.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tether", "run", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, f"the run exited {proc.returncode} before its first step"
            assert time.monotonic() < deadline, "timed out waiting for the first step"
            time.sleep(0.05)  # polling a file another process writes; the condition is the sync
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "tether.out").read_text()
    assert rc == 0, output[-5000:]
    events = jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert names[-1] == "stopped" and events[-1]["signal"] == signal.SIGTERM
    assert any(e["event"] == "checkpoint" and e["reason"] == "signal" for e in events), names
    check_clean_exit(run_dir)


def test_rank_that_raises_leaves_its_traceback_in_the_error_file(ws: Workspace, run_dir: Path) -> None:
    from support.e2e import jsonl, tether

    run_dir.mkdir()
    # A real fault, no hook in the product: the ranks cannot write their addresses where the
    # run directory has a file in place of the `trainer` directory, so each rank raises.
    (run_dir / "trainer").write_text("not a directory")
    done = tether("run", *ws.flags(run_dir, "--num-rollout", "2"), check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = sorted(p.name for p in (run_dir / "logs").glob("*error*.json"))
    assert errors == ["trainer-node0-error.json"]
    report = json.loads((run_dir / "logs" / errors[0]).read_text())["message"]
    assert report["message"].startswith("FileExistsError") and str(run_dir / "trainer") in report["message"]
    assert "in write_address" in report["extraInfo"]["py_callstack"]
    exits = {e["name"]: e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "process_exit"}
    assert (exits["trainer-node0"]["returncode"], exits["trainer-node0"]["expected"]) == (1, False)
    assert exits["engine0"]["returncode"] == 0 and exits["engine0"]["expected"] is True
    failed = [e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "failed"]
    assert len(failed) == 1 and "trainer-node0" in failed[0]["error"]

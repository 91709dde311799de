"""What the head checks and records at start, with processes: the heartbeat misses its agents
are told, and a "failed" line in events.jsonl for every failure, whatever its type (the bind
address against the plan: tests/unit/test_head_bind_address.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.e2e import Workspace, jsonl, tether

from tether.config import resolve
from tether.records.run_dir import read_jsonl
from tether.run.job import control_heartbeat
from tether.runtime.errors import ConfigError
from tether.runtime.loop import run
from tether.runtime.process.supervisor import Supervisor, _HeadService
from tether.runtime.rpc.secret import new_secret


def test_heartbeat_misses_reach_the_head_and_its_agents(tmp_path: Path) -> None:
    """--heartbeat-misses sets how many beats the head and each agent (told at its setup) may
    miss; 0 is refused."""
    hb = control_heartbeat(resolve(["--heartbeat-misses", "5"]))
    assert hb.misses == 5 and control_heartbeat(resolve([])).misses == 3

    async def setup() -> dict[str, object]:
        async with Supervisor(tmp_path, new_secret(), heartbeat=hb) as sup:
            return await _HeadService(sup).agent_setup()

    assert run(setup())["misses"] == 5
    with pytest.raises(ConfigError, match="heartbeat-misses"):
        resolve(["--heartbeat-misses", "0"])


def test_any_failure_ends_the_events_with_a_failed_line(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    """A failure of no special type (here: unreadable prompt data, found after the engines
    started) still ends events.jsonl with "failed", naming where and what."""
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("{not json\n")
    run = run_dir
    done = tether(
        "run",
        *ws.flags(run, "--num-rollout", "1", "--debug-rollout-only", "--prompt-data", str(bad)),
        check=False,
    )
    assert done.returncode != 0
    last = jsonl(run / "events.jsonl")[-1]
    assert last["event"] == "failed" and last["process"] == "head", last
    assert str(bad) in last["error"] or "prompts.jsonl" in last["error"], last


def test_sigterm_during_start_up_stops_cleanly(ws: Workspace, run_dir: Path) -> None:
    """A stop signal before the loop (SLURM's USR1 forwarded as TERM while engines start) ends
    the run with exit 0 and "stopped", so the job script requeues it; no process is left."""
    run = run_dir
    flags = ws.flags(run, "--num-rollout", "2", "--debug-rollout-only")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether", "run", *flags], env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "start" for e in read_jsonl(run / "events.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)  # polling a file the run writes; the condition is the sync
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = read_jsonl(run / "events.jsonl")
    assert events[-1]["event"] == "stopped" and "ready" not in [e["event"] for e in events], events
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)


# What the head imports only after it has started its first process: each is tens of ms (torch
# ~1.2 s) that would otherwise delay every engine and trainer rank.
IMPORTED_AFTER_THE_FIRST_PROCESS = ("torch", "numpy", "yaml", "rich", "aiohttp", "transformers")


# The head's step work, as the run imports it, for a grpo run (no torch: a tripwire refuses to
# build the module, while `find_spec`, which transformers asks, still answers) and one that uses
# torch. Each estimator's rollout is driven to its end with answers shaped as the ranks'.
STEP_WORK = """
import importlib.machinery, sys
import numpy as np
class Refuse:
    def create_module(self, spec):
        raise ImportError("torch imported by the head's grpo step work")
    def exec_module(self, module):
        pass
class Tripwire:
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Refuse()
        return spec
tripwire = Tripwire()
sys.meta_path.insert(0, tripwire)
from tether.run.trainer_pool import import_step_work
import_step_work(with_torch=False)
from tether.rollout.sample import Sample
from tether.train.config import AlgorithmConfig
from tether.train.rank.protocol import LogProbsResult, TrainResult
from tether.train.rank.rollout_calls import LogProbsCall, TrainCall, actor_calls
from tether.train.rank.work import WorkOptions
def sample(i):
    n = 2 + i % 3
    return Sample(index=i, group_index=i // 2, rollout_id=i, tokens=list(range(1, 4 + n)),
                  response_length=n, loss_mask=[1] * n, rollout_log_probs=[-0.5] * n, reward=float(i % 2))
for estimator in ("grpo", "gspo", "cispo"):
    groups = [[sample(2 * g), sample(2 * g + 1)] for g in range(4)]
    calls = actor_calls(groups, 5, AlgorithmConfig(advantage_estimator=estimator),
                        WorkOptions(global_batch_size=4), dp_size=2)
    results = None
    try:
        while True:
            call = calls.send(results)
            if isinstance(call, LogProbsCall):
                results = [LogProbsResult(log_probs=np.full(int(r.shard.loss_masks.size), -0.5, np.float32))
                           for r in call.requests]
            else:
                assert isinstance(call, TrainCall), call
                results = [TrainResult(metrics={"loss": 0.0}) for _ in call.requests]
    except StopIteration as done:
        assert done.value.steps == 2, done.value
    assert "torch" not in sys.modules
    print(estimator)
sys.meta_path.remove(tripwire)
import_step_work()
assert "torch" in sys.modules
print("torch")
"""


def test_the_head_starts_its_processes_before_its_heavy_imports(ws: Workspace, run_dir: Path) -> None:
    """The head's way to the first process a run starts (an engine) imports none of torch,
    numpy, yaml, rich (the bars on a terminal aside), aiohttp or transformers. The tokenizer and
    prompts load on a thread started beside it (held here, so that only the main path counts);
    the step work is imported on a thread once the trainer ranks start
    (`tether.run.trainer_pool.import_step_work`), torch with it only where that work uses it: a
    grpo rollout's step work runs to its end without it."""
    flags = ws.flags(run_dir, "--num-rollout", "1")
    at = flags.index("--custom-rm-path")  # the test's own reward hook is user code: not counted
    del flags[at : at + 2]
    code = (
        "import asyncio, json, os, sys\n"
        "async def first_process(*args, **kwargs):\n"
        f"    print(json.dumps([m for m in {IMPORTED_AFTER_THE_FIRST_PROCESS!r} if m in sys.modules]))\n"
        "    sys.stdout.flush(); os._exit(0)\n"
        "asyncio.create_subprocess_exec = first_process\n"
        "import threading, tether.run.job\n"
        "tether.run.job.load_rollout_inputs = lambda cfg: threading.Event().wait()\n"
        "from tether.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "run", *flags], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    done = subprocess.run([sys.executable, "-c", STEP_WORK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["grpo", "gspo", "cispo", "torch"]

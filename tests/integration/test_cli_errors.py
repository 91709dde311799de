"""Every subcommand, given a bad input as a user types it, ends with one line on stderr naming the
flag or file (no traceback); `tether --debug` and TETHER_DEBUG=1 bring the traceback back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tether.runtime.errors import DEBUG_ENV

# Variables that would change what the cases refuse (a key, the run secret, the debug switch).
_CLEARED = ("TETHER_ENGINE_API_KEY", "TETHER_SECRET", DEBUG_ENV)


class Case(NamedTuple):
    argv: list[str]  # after `tether`; "{tmp}" is the test's directory
    names: str  # the flag or file the line must name
    env: dict[str, str] | None = None


CASES: dict[str, Case] = {
    # The new user: a model directory but no key.
    "engine-without-key": Case(["engine", "--model-path", "{tmp}/model"], "--api-key-file"),
    "engine-missing-model": Case(["engine", "--model-path", "{tmp}/nowhere"], "--model-path"),
    "engine-bad-value": Case(["engine", "--model-path", "{tmp}/model", "--threads", "0"], "--threads"),
    "init-model-bad-value": Case(["init-model", "--out", "{tmp}/m", "--hidden", "0"], "--hidden"),
    "convert-missing-checkpoint": Case(
        ["convert", "hf-to-megatron", "--hf-checkpoint", "{tmp}/nowhere", "--save", "{tmp}/out"],
        "--hf-checkpoint",
    ),
    "convert-unwritable-output": Case(
        ["convert", "hf-to-megatron", "--hf-checkpoint", "{tmp}/weights", "--save", "{tmp}/a-file/out"],
        "--save",
    ),
    "init-model-unwritable-out": Case(["init-model", "--out", "{tmp}/a-file/m"], "--out"),
    "bench-engine-missing-model": Case(["bench", "engine", "--model-path", "{tmp}/nowhere"], "--model-path"),
    "weights-missing-checkpoint": Case(["weights", "verify", "{tmp}/nowhere"], "{tmp}/nowhere"),
    "agent-bad-address": Case(["agent", "--head", "localhost:1"], "--head"),
    "agent-without-secret": Case(["agent", "--head", "tcp://127.0.0.1:9"], "TETHER_SECRET"),
    "plot-missing-run": Case(["plot", "{tmp}/nowhere"], "{tmp}/nowhere/metrics.jsonl"),
    "bench-bad-value": Case(["bench", "runtime", "--repeats", "0"], "--repeats"),
    "bench-missing-compare": Case(["bench", "runtime", "--compare", "{tmp}/nowhere.json"], "--compare"),
    "plan-impossible-layout": Case(
        ["plan", "--cpu-devices", "1", "--actor-num-gpus-per-node", "4"], "--actor-num-"
    ),
    "plan-broken-yaml": Case(["plan", "--config", "{tmp}/broken.yaml"], "--config"),
    # No GPU in sight (CUDA_VISIBLE_DEVICES hides any this machine has) and no --cpu-devices.
    "run-without-gpu": Case(["run"], "--cpu-devices", {"CUDA_VISIBLE_DEVICES": ""}),
    "run-missing-config": Case(["run", "--config", "{tmp}/nowhere.yaml"], "--config"),
    "demo-bad-value": Case(["demo", "--samples", "1", "--out", "{tmp}/demo"], "--samples"),
}


def tether(tmp: Path, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in _CLEARED} | (env or {})
    cmd = [sys.executable, "-m", "tether", *(a.replace("{tmp}", str(tmp)) for a in argv)]
    return subprocess.run(cmd, cwd=tmp, env=environ, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """A model directory the engine gets past its path check with, one convert gets past its
    checks with, a broken YAML file, and a plain file no directory can be made under."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "broken.yaml").write_text("rollout_batch_size: [\n")
    (tmp_path / "weights").mkdir()  # passes convert's checks of --hf-checkpoint
    (tmp_path / "weights" / "config.json").write_text("{}")
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    (tmp_path / "a-file").write_text("")  # a directory cannot be made under it
    return tmp_path


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_a_bad_input_is_one_line_naming_it(inputs: Path, case: Case) -> None:
    done = tether(inputs, case.argv, case.env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"tether {case.argv[0]}"), lines[0]  # `tether weights verify: ...`
    assert case.names.replace("{tmp}", str(inputs)) in lines[0], lines[0]


def test_user_errors_exit_2_as_argparse_does(inputs: Path) -> None:
    # The status a bad command line gets from argparse, so scripts tell input errors from failures.
    for name in ("engine-without-key", "run-without-gpu", "plot-missing-run", "demo-bad-value"):
        assert tether(inputs, CASES[name].argv, CASES[name].env).returncode == 2, name
    refused = tether(inputs, ["demo", "--no-such-flag"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1] == "tether demo: error: unrecognized arguments: --no-such-flag"


def test_debug_shows_the_traceback(inputs: Path) -> None:
    case = CASES["engine-without-key"]
    for argv, env in (
        (["--debug", *case.argv], None),
        (case.argv, {DEBUG_ENV: "1"}),
    ):
        done = tether(inputs, argv, env)
        assert done.returncode != 0
        assert "Traceback" in done.stderr and "ConfigError: --api-key-file" in done.stderr, done.stderr


def test_the_engine_started_as_a_module_reports_the_same_line(inputs: Path) -> None:
    # How `tether run` starts engines: the line lands in the engine's log, where the head's
    # ActorDied quotes the last lines.
    cmd = [sys.executable, "-m", "tether.rollout.cpu_engine", "--model-path", str(inputs / "model")]
    environ = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    done = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("tether engine: --api-key-file: the engine needs an API key"), done.stderr

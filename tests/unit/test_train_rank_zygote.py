"""Trainer ranks forked from a zygote (train/rank/zygote.py, train/rank/preload.py) and the
head's overlapped start (head/run/job.py `overlap_start`): which launches fork, what the zygote
imports, how a forked rank's output behaves; no process is started here (the integration
tests' `tether run`s start their ranks this way)."""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings

import pytest
import torch
from torch.distributed.run import parse_args

from tether.config import resolve
from tether.placement.plan import TorchrunNode
from tether.run.job import overlap_start
from tether.train.rank import zygote as rank_zygote

NODE = TorchrunNode(
    node=0,
    hostname="node-a",
    node_rank=0,
    nnodes=1,
    nproc_per_node=2,
    first_rank=0,
    devices=[0, 1],
    cuda_visible_devices=None,
    rdzv_endpoint="127.0.0.1:29512",
    env={},
)
WORKER_ARGS = ["--rpc-address-dir", "/tmp/run/trainer", "--job", "trainer", "--ipc-dir", "/tmp/run/sock"]


def tether_argv(*torchrun_extra: str, module: str = rank_zygote.WORKER_MODULE) -> list[str]:
    """A torchrun command line as head/run/trainer_pool.py builds it."""
    return [*NODE.torchrun_args(), *torchrun_extra, "-m", module, *WORKER_ARGS]


def test_only_tethers_worker_module_is_forked() -> None:
    assert rank_zygote.runs_worker(tether_argv())
    assert not rank_zygote.runs_worker(tether_argv(module="my.trainer"))
    # The module's name as some argument's value is not the module torchrun runs.
    assert not rank_zygote.runs_worker(["--nnodes=1", "script.py", "--name", rank_zygote.WORKER_MODULE])


def test_the_switch_and_the_torch_build_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_build = not any(getattr(torch.version, name, None) for name in ("cuda", "hip", "xpu"))
    # Read from torch's version file without importing torch: the same answer as torch gives.
    assert rank_zygote.cpu_only_torch() == cpu_build
    monkeypatch.setenv(rank_zygote.SWITCH_ENV, "1")
    assert rank_zygote.wanted(tether_argv()) == cpu_build
    monkeypatch.setenv(rank_zygote.SWITCH_ENV, "0")
    assert not rank_zygote.wanted(tether_argv())


def test_only_the_launch_tether_plans_runs_forked() -> None:
    assert rank_zygote._tether_form(parse_args(tether_argv()))
    # Other rendezvous forms, scripts and modules run under plain torchrun.
    assert not rank_zygote._tether_form(
        parse_args(["--standalone", "--nproc-per-node=2", "-m", rank_zygote.WORKER_MODULE])
    )
    assert not rank_zygote._tether_form(
        parse_args(["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "-m", rank_zygote.WORKER_MODULE])
    )
    assert not rank_zygote._tether_form(parse_args(tether_argv(module="my.trainer")))
    assert not rank_zygote._tether_form(parse_args(["--nproc-per-node=2", "--no-python", "echo"]))


def test_the_zygote_imports_every_module_it_names() -> None:
    # A renamed or removed module would silently leave each rank to import it itself.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time deprecations (errors under pytest)
        from tether.train.rank import preload as rank_preload

        assert rank_preload.preload() == []
        assert gc.isenabled()  # back on, with the preloaded modules frozen for the forks
    assert rank_preload.FAILED == []
    for name in (*rank_preload.LEAN, *rank_preload.QUIET, *rank_preload.PLAIN):
        assert name in sys.modules, name


def test_a_forked_ranks_output_is_unbuffered_as_under_python_u() -> None:
    read, write = os.pipe()
    try:
        stream = rank_zygote._unbuffered(write, None)
        stream.write("rank 0 ready\n")
        stream.write("no newline")  # reaches the pipe without a flush, as with `python -u`
        assert os.read(read, 100) == b"rank 0 ready\nno newline"
    finally:
        os.close(read)
        os.close(write)


def test_engines_and_trainers_start_together_unless_they_must_not() -> None:
    base = ["--cpu-devices", "2", "--hf-checkpoint", "/m"]
    assert overlap_start(resolve([*base, "--num-rollout", "2"]))
    # --colocate: both would take the same devices' memory at once.
    assert not overlap_start(resolve([*base, "--num-rollout", "2", "--colocate"]))
    # --num-epoch alone: the rollouts are counted from the prompts before the trainers start.
    assert not overlap_start(resolve([*base, "--num-epoch", "1", "--prompt-data", "/p.jsonl"]))


def test_a_failed_ranks_traceback_is_logged_as_before_without_torchs_exception_path() -> None:
    try:
        raise RuntimeError("rank 1 died")
    except RuntimeError:
        record = logging.LogRecord("elastic", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    expected = logging.Formatter().formatException(record.exc_info)  # type: ignore[arg-type]
    assert rank_zygote.PlainTraceback().filter(record)
    # No exception left for torch's formatter to import TorchDynamo over; the same text is logged.
    assert record.exc_info is None and record.exc_text == expected
    assert logging.Formatter().format(record) == "failed\n" + expected
    assert "RuntimeError: rank 1 died" in expected


def test_the_zygote_is_forked_inline_only_from_a_forkserver_it_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing.forkserver as forkserver

    assert rank_zygote._inline_server() is forkserver._forkserver  # type: ignore[attr-defined]
    # A forkserver whose `main` takes other arguments (Python 3.14 authenticates clients) or
    # that already runs is left to the standard library.
    monkeypatch.setattr(forkserver, "main", lambda listener_fd, alive_r, preload, *, authkey_r=None: None)
    assert rank_zygote._inline_server() is None
    monkeypatch.undo()
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_authkey", b"k", raising=False)  # type: ignore[attr-defined]
    assert rank_zygote._inline_server() is None
    monkeypatch.undo()
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 1)  # type: ignore[attr-defined]
    assert rank_zygote._inline_server() is None

"""Trainer ranks forked from one process that imported their modules once (a zygote).

Every rank of `python -m tether.train.rank.worker` under torchrun imports torch, megatron-core and
mbridge (with transformers and TorchDynamo) from scratch: ~4 s of CPU per rank, all before the
first step, and on a machine with as many cores as ranks the ranks' imports share the cores
with the engines' and the head's. Here torchrun starts its ranks with the `forkserver` start
method instead: a fresh interpreter, started first thing in the torchrun agent, imports those
modules (`tether.train.rank.preload`) while the agent imports torch, and each rank is forked
from it. A forkserver holds no threads, no torch thread pool and no signal handlers of the
agent's, so a forked rank starts where a fresh one would after its imports.

A rank is still a real torchrun rank: the same elastic agent, rendezvous, per-rank environment,
error file (`record`), restarts (each restart forks again) and exit handling, only the entry
point is a function (`run_rank`) instead of a subprocess. Used where the command is tether's
own worker in the static rendezvous tether plans, and only with a torch built without CUDA/ROCm
(the zygote's imports could touch a GPU driver, which a forked child cannot use); anything else,
or TETHER_FORK_RANKS=0, runs torchrun exactly as before.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.runtime.process.proc_title import show_as

WORKER_MODULE = "tether.train.rank.worker"
PRELOAD_MODULE = "tether.train.rank.preload"
# "0" runs every rank as its own interpreter, as plain torchrun does (for comparisons and debugging).
SWITCH_ENV = "TETHER_FORK_RANKS"


def cpu_only_torch() -> bool:
    """Whether the installed torch was built without CUDA, ROCm and XPU, read from its version
    file without importing torch (the zygote starts before this process imports it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        facts = runpy.run_path(str(version))
    except Exception:  # unreadable: not known to be safe to fork from
        return False
    return not any(facts.get(name) for name in ("cuda", "hip", "xpu"))


def runs_worker(argv: Sequence[str]) -> bool:
    """Whether a torchrun command line runs tether's worker module (`... -m tether.train.rank.worker ...`)."""
    args = list(argv)
    return any(
        arg == WORKER_MODULE and i > 0 and args[i - 1] in ("-m", "--module") for i, arg in enumerate(args)
    )


def wanted(argv: Sequence[str]) -> bool:
    """Whether this torchrun launch should fork its ranks from a zygote (see the module docstring)."""
    return (
        os.environ.get(SWITCH_ENV, "1") != "0"
        and sys.platform == "linux"
        and runs_worker(argv)
        and cpu_only_torch()
    )


def start() -> None:
    """Start the zygote now: it imports the ranks' modules while this process goes on."""
    import multiprocessing.forkserver as forkserver

    forkserver.set_forkserver_preload([PRELOAD_MODULE])
    forkserver.ensure_running()


def _tether_form(args: argparse.Namespace) -> bool:
    """The launch tether plans (trainer_pool): a module, static rendezvous at a given master
    address and port, the rank's environment read from env (torchrun's defaults for the rest)."""
    from torch.distributed.run import get_use_env

    return bool(
        args.module
        and args.training_script == WORKER_MODULE
        and not args.no_python
        and not args.run_path
        and not args.standalone
        and args.rdzv_backend == "static"
        and args.master_port is not None
        and get_use_env(args)
    )


def launch(argv: Sequence[str]) -> bool:
    """Run torchrun's agent over `argv` with ranks forked from the zygote; False (nothing run)
    where `argv` is not the form tether plans, for plain torchrun to run instead."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args

    args = parse_args(list(argv))  # torchrun's own parser: the same reading of the same flags
    if not _tether_form(args):
        return False
    record(_launch)(args)  # as torchrun's main: the agent's own failure goes to the error file
    return True


class PlainTraceback(logging.Filter):
    """Formats a log record's exception with logging's own formatter, the text torch's would give.

    torchrun logs a failed function-entry rank with its traceback (`logger.exception`), and torch's
    log formatter imports TorchDynamo to decide whether to format one: ~0.5 s of CPU (seconds on a
    loaded machine) between a rank's death and the agent's exit, which a subprocess rank's plain
    error line never cost. The text is formatted here and the exception dropped from the record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


def _launch(args: argparse.Namespace) -> None:
    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    torch.multiprocessing._set_thread_name("pt_elastic")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(PlainTraceback())
    # The same config torchrun builds (and its OMP_NUM_THREADS default); only the start method
    # and the entry point differ: the worker's arguments go to `run_rank` as they would to the module.
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    elastic_launch(config=config, entrypoint=run_rank)(*args.training_script_args)


def _unbuffered(fd: int, like: Any) -> io.TextIOWrapper:
    """A text stream on `fd` as `python -u` makes it: no buffer below, every write passed on."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False),
        encoding=getattr(like, "encoding", None),
        errors=getattr(like, "errors", None),
        write_through=True,
    )


def _let_the_zygote_end_with_the_agent() -> None:
    """Drop the forkserver's liveness pipe that every forked child inherits.

    The zygote exits when no process holds that pipe's write end any more; while ranks held it,
    a SIGKILLed agent would leave the zygote, and with it the ranks, alive (a rank dies with
    its parent: `die_with_parent` in the worker, whose parent here is the zygote). Without it
    the chain is the one a plain torchrun rank has: agent gone, zygote gone, rank signalled.
    A later forkserver use in this rank starts its own, as in a fresh process.
    """
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    fd = server._forkserver_alive_fd
    server._forkserver_alive_fd = None
    if fd is not None:
        os.close(fd)


def run_rank(*argv: str) -> int:
    """A forked rank: what `python -u -m tether.train.rank.worker ARGV` runs, in this process."""
    from tether.train.rank import worker

    _let_the_zygote_end_with_the_agent()
    sys.argv = [str(worker.__file__), *argv]
    with contextlib.suppress(Exception):  # cosmetic: ps shows the rank, not the forkserver
        show_as([sys.executable, "-u", "-m", WORKER_MODULE, *argv])
    sys.stdout = _unbuffered(1, sys.stdout)
    sys.stderr = _unbuffered(2, sys.stderr)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # A fresh rank's OpenMP reads this when torch loads; the zygote loaded it before the
        # agent set the ranks' environment.
        import torch

        torch.set_num_threads(int(threads))
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description=worker.__doc__)
    worker.add_arguments(parser)
    return worker.main(parser.parse_args(list(argv)))

"""Trainer ranks forked from one process that imported their modules once (a zygote).

Every rank of `python -m tether.train.rank.worker` under torchrun imports torch, megatron-core and
mbridge (with transformers and TorchDynamo) from scratch: ~4 s of CPU per rank, all before the
first step, and on a machine with as many cores as ranks the ranks' imports share the cores
with the engines' and the head's. Here torchrun starts its ranks with the `forkserver` start
method instead, from a zygote that imported those modules once (`tether.train.rank.preload`):
the torchrun agent imports them first thing, then forks the zygote from itself before torchrun starts
its threads (where the standard library's forkserver is one `start` knows; else a fresh
interpreter imports them while the agent imports torch), and each rank is forked from the
zygote. The zygote holds no threads, no torch thread pool and no signal handlers of the
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
    """Start the zygote now, before torchrun starts its threads in this process.

    Where the standard library's forkserver is the one this module knows (`_inline_server`),
    this process imports the ranks' modules itself and forks the zygote from itself: one import
    of torch and the rest for the agent, the zygote and every rank, instead of one in the agent
    and one in a spawned forkserver (measured: ~1 CPU-second less before the first step, on a
    machine whose start-up is bound by CPU). Elsewhere a spawned forkserver imports them while
    this process goes on.
    """
    import multiprocessing.forkserver as forkserver

    server = _inline_server()
    if server is None:
        forkserver.set_forkserver_preload([PRELOAD_MODULE])
        forkserver.ensure_running()
        return
    importlib.import_module(PRELOAD_MODULE)
    _fork_server(server)


# The forkserver `main` whose arguments `_fork_server` passes (Python 3.11 to 3.13); a later
# one (3.14 authenticates its clients) gets the spawned zygote instead.
_KNOWN_MAIN = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
_KNOWN_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
ZYGOTE_TITLE = ["tether-rank-zygote", "(torchrun's forkserver, forked from its agent)"]


def _inline_server() -> Any | None:
    """The process's forkserver client, when a forked zygote can serve it; else None."""
    import inspect
    import multiprocessing.forkserver as forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    if server is None:
        return None
    try:
        params = tuple(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return None
    known = params == _KNOWN_MAIN and all(hasattr(server, a) for a in _KNOWN_STATE)
    if not known or hasattr(server, "_forkserver_authkey") or server._forkserver_pid is not None:
        return None
    return server


def _fork_server(server: Any) -> None:
    """Fork the zygote from this process and make it this process's forkserver: what
    `ForkServer.ensure_running` sets up, with a fork of this process in place of a fresh one."""
    import multiprocessing.forkserver as forkserver
    import socket
    from multiprocessing import connection, util

    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the zygote's copy of a buffer could be written twice
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):  # type: ignore[attr-defined]
            os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end; the zygote exits once none does (the agent is gone).
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote: it never returns from here
            code = 1
            try:
                _keep_only(0, 1, 2, listener.fileno(), alive_r)  # as a spawned one holds
                with contextlib.suppress(Exception):
                    show_as(ZYGOTE_TITLE)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit as e:  # its way out once the alive pipe closes
                code = e.code if isinstance(e.code, int) else 0
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def _keep_only(*fds: int) -> None:
    """Close every file descriptor but `fds`."""
    low = 0
    for fd in sorted(set(fds)):
        if low < fd:  # closerange(0, 0) closes every descriptor (Python 3.11)
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


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

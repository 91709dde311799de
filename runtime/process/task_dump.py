"""SIGUSR2 → every asyncio task's stack, written to a file: what a hung head is waiting for.

Hangs nobody can attach a debugger to are what users leave Ray over; `kill -USR2 <head pid>`
answers "what is it waiting on?" without stopping anything.
"""

from __future__ import annotations

import asyncio
import io
import signal
import time
from pathlib import Path


def dump_tasks(path: Path) -> Path:
    """Write the stack of every task of the running loop to `path`."""
    out = io.StringIO()
    tasks = asyncio.all_tasks()
    out.write(f"{len(tasks)} tasks at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"\n--- {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(file=out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    return path


def install(directory: Path) -> None:
    """On SIGUSR2, dump the tasks into `directory`/tasks-<time>.txt (call inside the running loop)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGUSR2, lambda: dump_tasks(directory / f"tasks-{time.strftime('%Y%m%d-%H%M%S')}.txt")
    )

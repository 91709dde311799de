"""What `ps` and `pgrep -f` show for a forked process: its own command line, not its zygote's.

A process forked from a zygote (runtime/process/zygote.py, train/rank/zygote.py) keeps the zygote's
command line in /proc/PID/cmdline, which names the zygote, not the actor, engine client or
trainer rank running there; an operator looking for a hung rank with `ps` or `py-spy` could not
tell them apart. `show_as` writes the command the process would have had if spawned over the
memory the kernel shows (written here rather than with setproctitle: it is the one call we need,
and the room is known from /proc/self/stat).
"""

from __future__ import annotations

import ctypes
import os


def show_as(argv: list[str]) -> None:
    """Make this process's /proc/PID/cmdline show `argv`, cut to the room of the command line it
    was started with (a zygote started with a padded command line leaves its children more)."""
    with open("/proc/self/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    room = end - start
    if start <= 0 or room <= 1:
        return
    text = b"\0".join(os.fsencode(a) for a in argv)[: room - 1]
    # The interpreter keeps its own copies of argv: this memory is only what the kernel shows.
    ctypes.memmove(start, text + b"\0" * (room - len(text)), room)

"""Run by tests/integration/test_rank_zygote_inline.py in a fresh interpreter: starts the rank
zygote as the torchrun agent does (with a light module in place of the ranks' preload), then
forks one child from it and prints what the test checks, one JSON object."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
from typing import Any

from tether.train.rank import zygote as rank_zygote

MARKER = "tests.support.zygote_preload_marker"


def child(conn: Any) -> None:
    marker = sys.modules.get(MARKER)
    conn.send(
        {
            "pid": os.getpid(),
            "parent": os.getppid(),
            "marker_imported_by": None if marker is None else marker.IMPORTED_BY,
        }
    )
    conn.close()


def main() -> None:
    held = tempfile.TemporaryFile()  # a descriptor the agent holds before the fork
    held_path = os.readlink(f"/proc/self/fd/{held.fileno()}")
    rank_zygote.PRELOAD_MODULE = MARKER
    inline = rank_zygote._inline_server() is not None
    rank_zygote.start()
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    zygote = server._forkserver_pid
    ctx = multiprocessing.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(send,))
    proc.start()
    send.close()
    got = recv.recv()
    proc.join()
    fds = sorted(int(fd) for fd in os.listdir(f"/proc/{zygote}/fd"))
    held_in_zygote = any(os.readlink(f"/proc/{zygote}/fd/{fd}") == held_path for fd in fds)
    title = open(f"/proc/{zygote}/cmdline", "rb").read().split(b"\0")[0].decode()
    parent = int(open(f"/proc/{zygote}/stat").read().rsplit(")", 1)[1].split()[1])
    print(
        json.dumps(
            {
                "inline": inline,
                "agent": os.getpid(),
                "zygote": zygote,
                "zygote_parent": parent,
                "zygote_title": title,
                "held_in_zygote": held_in_zygote,
                "marker_here": sys.modules[MARKER].IMPORTED_BY if MARKER in sys.modules else None,
                "child": got,
                "exitcode": proc.exitcode,
            }
        ),
        flush=True,
    )
    held.close()


if __name__ == "__main__":
    main()

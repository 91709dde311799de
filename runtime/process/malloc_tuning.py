"""Keep large ZeroMQ message buffers in the malloc heap of an actor process.

libzmq allocates one buffer per received message. glibc serves multi-MiB requests with a
fresh mmap and unmaps it on free, so every bulk frame costs a page fault per 4 KiB page plus
zeroing (measured: about a fifth of an actor's CPU while it receives Sample batches). Raising
the mmap threshold to `MMAP_THRESHOLD` and the trim threshold to `TRIM_THRESHOLD` lets freed
buffers be reused: the process keeps up to `TRIM_THRESHOLD` of freed memory instead of
returning it to the kernel at once. Set TETHER_MALLOC_TUNING=0 to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
ENV = "TETHER_MALLOC_TUNING"


def tune_malloc() -> bool:
    """Apply the thresholds (glibc only); True when they took effect."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        # The process's own symbols (libc among them): find_library("c") would run ldconfig
        # in a subprocess, some 10-150 ms of every actor's start.
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the thresholds; malloc left as it was")
    return ok

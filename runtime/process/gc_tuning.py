"""Start-up imports without the cyclic garbage collector.

Importing torch, transformers and megatron-core allocates hundreds of thousands of container
objects; every 700 of them start a young-generation collection, and the older generations are
walked again and again, to find almost nothing: a module's objects live as long as the process.
Measured on this 2-core machine: the rank zygote's preload (torch, megatron-core, mbridge) took
2.50-2.58 s with the collector on and 2.11-2.14 s with it off; torch + megatron-core alone
1.25-1.40 s against 1.08 s.

`imports_without_gc()` turns the collector off for a block of imports, then freezes what exists
(`gc.freeze`: later collections skip those objects, and a forked child's collections do not
touch, and so do not copy, the pages its parent filled) and turns it back on. Set
TETHER_STARTUP_GC=1 to leave the collector on.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

ENV = "TETHER_STARTUP_GC"


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block with the collector off; freeze what it made and turn the collector back on.

    Does nothing when the collector is already off (an enclosing block, or the caller's own
    choice, which it keeps) or when TETHER_STARTUP_GC=1.
    """
    if not gc.isenabled() or os.environ.get(ENV) == "1":
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()

"""The head process runs torch with one intra-op thread.

The head's tensor work is small (advantages, batch shapes: a few hundred elements per step), but
torch starts one OpenMP thread per core for it, and on a machine whose cores the engines and
trainer ranks keep busy each parallel op waits for a descheduled thread: `repeat_interleave`
over the demo's 128 samples took 1.3-3.5 ms with 2 threads on 2 busy cores and 11 us with one.
The engines and trainer ranks set their own thread counts (--threads; OMP_NUM_THREADS=1 for the
ranks), so this changes only the head. The head imports torch while its trainer ranks start
where its step work uses it (`tether.run.trainer_pool`), and sets this on its event loop's thread
then: OpenMP keeps the thread count per calling thread. Where the step work needs no torch, a
user's hook may still import it: the step work sets it as soon as it finds torch imported.
"""

from __future__ import annotations

import sys


def one_torch_thread() -> None:
    """Keep this process's torch to one intra-op thread (see the module docstring)."""
    import torch

    torch.set_num_threads(1)


def one_torch_thread_if_imported() -> None:
    """`one_torch_thread()` on the calling thread where torch is imported (by anything) and not
    yet set to one thread there; nothing where torch is not imported."""
    torch = sys.modules.get("torch")
    get, set_threads = getattr(torch, "get_num_threads", None), getattr(torch, "set_num_threads", None)
    if get is not None and set_threads is not None and get() != 1:
        set_threads(1)

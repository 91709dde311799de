"""What the rank zygote (`tether.train.rank.zygote`) imports once for every rank it forks.

Importing this module is the work: each module below is one a trainer rank imports before its
first step anyway, imported the way the rank itself imports it (megatron-core lean as in
`tether.train.rank.worker.main`, the rest quiet as in `tether.train.model.build` and
`tether.train.model.bridge`), so a forked rank finds them loaded and runs the same code as a fresh
one. A failure here is left for the rank to meet again in its own import, where its error file
records it.
"""

from __future__ import annotations

import importlib

# Imported under `lean_megatron_imports`, as the worker's `main` does.
LEAN = ("megatron.core",)
# Imported under `quiet_megatron_imports`, as the rank's own call sites do.
QUIET = (
    "megatron.core.models.gpt",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.mlp",
    "mbridge.core.bridge",
    "mbridge.core.parallel_states",
)
# Not `mbridge.models`: its package imports every family's bridge; the rank imports its own
# family's module when it builds the model (tether.train.model.mbridge_import).
# The rank's own modules (and the torchrun pieces a forked rank unpickles its entry point with).
PLAIN = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch._dynamo",  # torch.optim's constructors import it at their first call (_disable_dynamo)
    "uvloop",
    "tether.runtime.rpc.actors",
    "tether.train.rank.worker",
    "tether.train.model.build",
    "tether.train.model.bridge",
    "tether.train.parallel.topology",
    "tether.train.rank.step",
    "tether.train.checkpoint.load_save",
)
# Not here: what a rank imports only at its first weight sync (tether.sync.factory, aiohttp,
# tether.train.checkpoint.export): ~0.2 s more before every rank could fork, for no earlier first step.


def preload() -> list[str]:
    """Import every module above; returns those that failed to import (for the tests)."""
    from tether.runtime.process.deferred_package import defer_transformers_models
    from tether.runtime.process.gc_tuning import imports_without_gc
    from tether.train.model.mbridge_import import defer_mbridge
    from tether.train.model.megatron_cpu import lean_megatron_imports, quiet_megatron_imports

    failed: list[str] = []

    def load(name: str) -> None:
        try:
            importlib.import_module(name)
        except Exception:  # the rank imports it again and reports the error itself
            failed.append(name)

    with imports_without_gc():
        defer_mbridge()  # mbridge's package __init__s run only if something asks for all of it
        defer_transformers_models()  # so does transformers.models' (it reads 400 models' sources)
        with lean_megatron_imports():
            for name in LEAN:
                load(name)
        with quiet_megatron_imports():
            for name in QUIET:
                load(name)
        for name in PLAIN:
            load(name)
    return failed


FAILED = preload()

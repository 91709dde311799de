"""What the secret-less zygote imports once for every CPU engine it forks (`ProcessSpec.preload`).

Importing this module is the work: the modules `tether.rollout.cpu_engine.server.serve` imports
before it loads a model (torch, aiohttp's server, the tokenizer, the engine's own), so a forked
engine starts at its model load, where a spawned one spends ~1.4 CPU-seconds importing first.
A module that fails here is left for the engine to meet again in its own import, where its log
says why.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = (
    "torch",
    "aiohttp.web",
    "tokenizers",
    "uvloop",
    "tether.rollout.cpu_engine.server",
    "tether.rollout.engine_api.auth",
    "tether.runtime.rpc.secret",
    "tether.rollout.cpu_engine.http.common",
    "tether.rollout.cpu_engine.http.sglang_api",
    "tether.rollout.cpu_engine.modeling.model",
    "tether.rollout.cpu_engine.scheduler",
)

for _name in MODULES:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)

"""Colocated runs: which trainer rank shares each engine rank's device.

A colocated weight sync hands every engine TP rank a CUDA IPC handle of a tensor on its own GPU
(an engine rank cannot open a handle of a GPU outside its CUDA_VISIBLE_DEVICES), so each entry
comes from the actor rank on that GPU. An engine's TP rank i runs on the i-th device of its parts
in node-rank order (SGLang's base GPU + i on each node); an actor rank's device is its local
rank's in its torchrun node's device list.
"""

from __future__ import annotations

from tether.placement.plan import Plan
from tether.runtime.errors import ConfigError


def handle_sources(plan: Plan) -> list[list[int]]:
    """For each engine tether starts (plan order), the actor's global rank on each of its TP
    ranks' devices, in TP-rank order. Raises ConfigError for an engine rank on a device no actor
    rank uses (a colocated sync could not reach it)."""
    actor = plan.train_group("actor")
    if actor is None:
        raise ConfigError("--colocate", True, "the plan has no actor ranks to share the engines' devices")
    rank_on = {
        (launch.node, device): launch.first_rank + local
        for launch in actor.nodes
        for local, device in enumerate(launch.devices)
    }
    sources = []
    for engine in plan.engines:
        if engine.external or engine.worker_type == "placeholder":
            continue
        row = []
        for part in sorted(engine.parts, key=lambda p: p.node_rank):
            for device in part.devices:
                rank = rank_on.get((part.node, device))
                if rank is None:
                    raise ConfigError(
                        "--rollout-num-gpus",
                        sum(len(p.devices) for e in plan.engines for p in e.parts),
                        f"under --colocate every engine device must be an actor device: engine "
                        f"{engine.index} uses device {device} of {part.hostname}, where no actor rank "
                        f"runs (the actor has {actor.world_size}); give the engines at most the actor's devices",
                    )
                row.append(rank)
        sources.append(row)
    return sources

"""Rollout capacity that comes and goes while a run runs: nodes that join, nodes drained.

`tether agent --join` registers a node new to the run: `check_join` refuses it at once when
the run cannot take it (a node of the plan, a colocated run, an engine layout of prefill and
decode workers, a weight transport that cannot grow), else places its engines with the
placement sorter (tether.placement.join); `join` starts them, catches them up to the served
weights and routes to them (EnginePool.add_engines), and records `capacity_added`.
`tether drain` (or SIGUSR2 to the node's agent) calls `drain`: the node's engines finish or
hand back their requests, stop, and leave the weight syncs; `capacity_drained` is recorded.

Weights reach a joined engine as they reach a rejoined one (Steps.catch_up): from disk for
the disk and delta transports, and with the distributed (NCCL/gloo) transport by a sync that
builds the update group afresh for the engines of the moment (each sync with another set of
engines does, and sizes the group from them, `EnginePool.sizes_of`; under
--pipeline-model-parallel-size > 1 every stage's source rebuilds its own group).
"""

from __future__ import annotations

from typing import Any

from tether.config import Config
from tether.placement.join import place_joined
from tether.placement.plan import Engine, Plan, PlanNode
from tether.records.run_dir import RunDir
from tether.run.engine_pool import EnginePool

DRAIN_GRACE_S = 30.0
"""Seconds a drained engine's requests in flight get to finish before they are aborted (their
groups requeued whole, generated again elsewhere)."""


def growth_refusal(cfg: Config, plan: Plan) -> str | None:
    """Why this run's rollout capacity cannot change while it runs, or None when it can."""
    if plan.colocate:
        return "--colocate: the engines share the trainer's devices, and a joined node has none of them"
    if plan.mode not in ("decoupled", "debug-rollout-only") or any(e.external for e in plan.engines):
        return f"the run's engines are external (plan mode {plan.mode!r}); tether starts none of them"
    if any(e.worker_type != "regular" for e in plan.engines):
        return (
            "the run's engines are prefill/decode workers (--sglang-config); a joined node's would be neither"
        )
    return None


class RunCapacity:
    """The run's side of `Supervisor.capacity` (see the module docstring)."""

    def __init__(
        self, cfg: Config, plan: Plan, names: dict[int, str], run_dir: RunDir, pool: EnginePool
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.names = names
        self.run_dir = run_dir
        self.pool = pool
        self.joined: list[PlanNode] = []  # in join order, indexed after the plan's nodes
        self.joined_engines: list[Engine] = []
        self._placed: dict[str, tuple[PlanNode, list[Engine]]] = {}  # checked, not yet started

    def check_join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        if node in self.names.values():
            raise ValueError(f"node {node!r} is a node of the run's plan; start its agent without --join")
        why = growth_refusal(self.cfg, self.plan)
        if why is not None:
            raise ValueError(f"node {node!r} cannot join this run: {why}")
        devices = inventory.get("join_devices")
        self._placed[node] = place_joined(
            self.plan,
            self.cfg.cluster,
            hostname=node,
            address=str(inventory.get("address") or address.rpartition(":")[0].removeprefix("tcp://")),
            devices=None if devices is None else [int(d) for d in devices],
            joined=self.joined,
            joined_engines=self.joined_engines,
            sglang_args=self.cfg.sglang_args,
        )
        # Taken now: a second node joining before this one's engines start is placed after it.
        placed, engines = self._placed[node]
        self.joined.append(placed)
        self.joined_engines.extend(engines)

    async def join(self, node: str, address: str, inventory: dict[str, Any]) -> None:
        placed, engines = self._placed.pop(node)
        started = await self.pool.add_engines(engines, node, placed.address)
        self.run_dir.event(
            "capacity_added",
            node=node,
            address=placed.address,
            engines=started,
            urls=[f"http://{e.address}" for e in engines],
            version=self.pool.served_version,
        )

    async def drain(self, node: str) -> dict[str, Any]:
        why = growth_refusal(self.cfg, self.plan)
        if why is not None and self.pool.on_node(node):
            raise ValueError(f"node {node!r} cannot be drained: {why}")
        requests = await self.pool.drain(node, DRAIN_GRACE_S)
        version = self.pool.served_version
        self.run_dir.event(
            "capacity_drained", node=node, engines=list(requests), requests=requests, version=version
        )
        return {"engines": list(requests), "version": version}

"""What a live head answers to `tether status` on its control socket: the run's records
(tether.records.run_status) brought up to date with what the head knows now — which nodes'
agents answer, each engine's state, version and load, the trainer processes, the step."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from tether.placement.plan import Plan
from tether.records.run_status import from_records
from tether.run.steps import Steps
from tether.runtime.process.supervisor import Supervisor


def live_status(
    sup: Supervisor, plan: Plan, names: dict[int, str], holder: list[Steps]
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """`sup.status_provider` for this run; `holder` gets the run's Steps once they exist."""
    host = {names[n.index]: n.hostname for n in plan.nodes}

    async def provide() -> dict[str, Any]:
        status = await asyncio.to_thread(from_records, sup.run_dir)
        status.source = "live"
        states = sup.node_states()
        for row in status.nodes:
            # A joined node is named by its agent, as the supervisor knows it.
            node = row.node if row.joined else next((n for n, h in host.items() if h == row.node), None)
            if node in states:
                row.state, row.reason = states[node]["state"], states[node]["reason"]
        if holder:
            steps = holder[0]
            status.step, status.version = steps.completed, steps.version
            status.state = "running" if status.state == "starting" else status.state
            if steps.engines is not None:
                now = steps.engines.states()
                for erow in status.engines:
                    if erow.engine in now:
                        erow.state, erow.version, erow.load = now[erow.engine]
                        erow.restarts = steps.engines.restarts.get(erow.engine, 0)
            if steps.trainer is not None:
                pools = [pool for pool in (steps.trainer, steps.trainer.critic) if pool is not None]
                running = {p.name: p.running for pool in pools for p in pool.procs}
                for rrow in status.trainer:
                    if rrow.process in running:
                        rrow.state = "running" if running[rrow.process] else "exited"
        return dict(msgspec.to_builtins(status))

    return provide

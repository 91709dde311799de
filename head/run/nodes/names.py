"""Which supervisor node (the head's own, or a registered agent) runs each node of the plan."""

from __future__ import annotations

import os
import socket

from tether.placement.plan import Plan
from tether.runtime.process.supervisor import LOCAL


def node_names(plan: Plan, this_host: str | None = None) -> dict[int, str]:
    """Plan node index → supervisor node name.

    The head's own node is `local`: the plan node named like this host (TETHER_NODE_NAME or the
    hostname), else the first node (launch scripts start the head there). Every other node is
    run by the agent registered under that node's hostname (`tether agent --node-name HOST`).
    """
    host = this_host or os.environ.get("TETHER_NODE_NAME") or socket.gethostname()
    own = next((n.index for n in plan.nodes if n.hostname == host), plan.nodes[0].index if plan.nodes else 0)
    return {n.index: (LOCAL if n.index == own else n.hostname) for n in plan.nodes}


def used_nodes(plan: Plan) -> set[int]:
    """Plan nodes that run a trainer rank or an engine tether starts."""
    used = {node.node for group in plan.train_groups for node in group.nodes}
    return used | {part.node for engine in plan.engines if not engine.external for part in engine.parts}


def remote_nodes(plan: Plan, names: dict[int, str]) -> list[str]:
    """Agents the plan needs, for nodes that run a trainer rank or an engine."""
    return sorted({names[i] for i in used_nodes(plan)} - {LOCAL})

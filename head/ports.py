"""Ports a plan binds on this machine, and a plan whose ports are all free here.

Placement hands out ports deterministically from each node's range. Two runs on one machine
(or a leftover server) would then collide, and a readiness probe could even be answered by the
other run's engine. So before anything starts, the head checks every port the plan binds on
this machine and, if one is taken, plans again from a range shifted past the taken block.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import msgspec

from tether.placement.config import ClusterConfig
from tether.placement.plan import Plan
from tether.runtime.errors import ConfigError

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def local_ports(plan: Plan) -> list[tuple[str, int]]:
    """(host, port) pairs the plan binds on this machine."""
    found: list[tuple[str, int]] = []
    for group in plan.train_groups:
        found.append(_split(group.rdzv_endpoint))
    for engine in plan.engines:
        if engine.external:
            continue
        found.append((engine.host, engine.http_port))
        if engine.nccl_port is not None:
            found.append((engine.host, engine.nccl_port))
        if engine.dist_init_addr is not None:
            found.append(_split(engine.dist_init_addr))
    if plan.weight_sync is not None:
        found.append((plan.weight_sync.master_addr, plan.weight_sync.master_port))
    return sorted({(h, p) for h, p in found if h in LOCAL_HOSTS or h.startswith("127.")})


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def plan_with_free_ports(
    cluster: ClusterConfig,
    make: Callable[[ClusterConfig], Plan],
    *,
    is_free: Callable[[str, int], bool] = port_free,
) -> Plan:
    """The plan from `cluster`, its port range moved up until every local port it binds is free."""
    first, last = cluster.node_port_first, cluster.node_port_last
    current = cluster
    while True:
        plan = make(current)
        ports = local_ports(plan)
        taken = [(h, p) for h, p in ports if not is_free(h, p)]
        if not taken:
            return plan
        shift = max(p for _, p in ports) + 1
        if shift + (max(p for _, p in ports) - current.node_port_first) > last:
            raise ConfigError(
                "--node-port-first",
                first,
                f"no free block of ports in {first}..{last} on this machine (taken: {taken[:4]}); "
                "widen --node-port-last or stop what holds them",
            )
        current = msgspec.structs.replace(current, node_port_first=shift)

"""The deterministic bundle sorter: nodes by address, then devices by physical index.

Rank order follows this order, so the same cluster discovered in any order yields the same plan
(and the same weight-sync rank layout).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from tether.placement.inventory import Node, resolve_host

# (family: 0 IPv4, 1 IPv6, 2 unresolved name; numeric value; name) — IPv4 sorts numerically,
# IPv6 by value, a host name by the address it resolves to, or else by the name itself.
NodeKey = tuple[int, int, str]


def node_key(address: str, resolve: Callable[[str], str | None] = resolve_host) -> NodeKey:
    """The sort key of one node address."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        resolved = resolve(address)
        try:
            ip = ipaddress.ip_address(resolved) if resolved is not None else None
        except ValueError:
            ip = None
    if ip is None:
        return (2, 0, address)
    return (0 if ip.version == 4 else 1, int(ip), address)


def sort_nodes(nodes: Iterable[Node], resolve: Callable[[str], str | None] = resolve_host) -> list[Node]:
    """Nodes in rank order, each with its GPUs in physical index order; names resolve once each."""
    keyed = [(node_key(node.address, resolve), node.hostname, node) for node in nodes]
    keyed.sort(key=lambda item: (item[0], item[1]))
    return [
        Node(hostname=node.hostname, address=node.address, gpus=sorted(node.gpus, key=lambda g: g.index))
        for _, _, node in keyed
    ]

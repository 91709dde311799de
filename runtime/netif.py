"""A node's address on this machine: the interface that holds it, and sockets bound to it.

Every node of a plan has an address (the inventory's: how the head and the other nodes reach
it). Collectives and TCP stores of the processes tether starts on a node must use that address:
gloo otherwise advertises whatever the hostname resolves to (127.0.0.1, or 127.0.1.1 on
Debian/Ubuntu), which no other node can reach, and a TCP store listens on every interface.

- `socket_ifname_env` is the environment that binds gloo and NCCL to the interface holding
  the address (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`); node agents lay it over the
  environment of each process they start. A value the user set already wins.
- `bound_listener` is a listening socket on the address alone, for a TCP store's server
  (`torch.distributed.TCPStore(..., master_listen_fd=...)`).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # fe80::1%eth0: the scope is not the address
    except ValueError:
        return None


def resolve_addresses(host: str) -> list[str]:
    """The IP addresses `host` names (itself when it is one), IPv4 first; [] when it does not resolve."""
    host = host.strip("[]")
    if _ip(host) is not None:
        return [host]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos}, key=lambda a: (":" in a, a))


def interface_holding(host: str, interfaces: Mapping[str, Sequence[Any]] | None = None) -> str | None:
    """The name of this machine's network interface that holds `host`'s address, or None.

    `interfaces` is `psutil.net_if_addrs()` (the default): name → entries with `.family` and
    `.address`. A loopback address not assigned itself (127.0.0.2) is held by the loopback
    interface, which routes all of 127.0.0.0/8.
    """
    wanted = {ip for ip in map(_ip, resolve_addresses(host)) if ip is not None}
    if not wanted:
        return None
    table = psutil.net_if_addrs() if interfaces is None else interfaces
    held: list[tuple[str, IpAddress]] = []
    for name, entries in table.items():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                ip = _ip(str(entry.address))
                if ip is not None:
                    held.append((name, ip))
    for name, ip in held:
        if ip in wanted:
            return name
    if any(ip.is_loopback for ip in wanted):
        return next((name for name, ip in held if ip.is_loopback and ip.version == 4), None)
    return None


def socket_ifname_env(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that holds `host`, each
    unless `environ` sets it already (the user's choice wins); {} when no interface holds it.

    NCCL reads its variable as a prefix unless it starts with '=': `=eth1` is eth1 alone.
    """
    name = interface_holding(host) if host else None
    if name is None:
        return {}
    wanted = {GLOO_IFNAME_ENV: name, NCCL_IFNAME_ENV: f"={name}"}
    return {key: value for key, value in wanted.items() if key not in environ}


def bound_listener(host: str, port: int, backlog: int = 1024) -> socket.socket | None:
    """A TCP socket listening on `host`'s address alone at `port` (0: a free port), or None
    when that address cannot be bound here (not this machine's, or the port is taken): the
    caller then listens as it would without one.
    """
    for address in resolve_addresses(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EAFNOSUPPORT):
                continue
            raise
        return sock
    return None

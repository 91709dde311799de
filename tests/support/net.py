"""Free ports on loopback, the one place tests ask the kernel for them."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` right now (the kernel's choice)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the kernel's choice)."""
    return free_ports(1, host)[0]


def port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(size: int = 100, hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2")) -> int:
    """The first port of `size` consecutive ports whose first ten are free on every one of `hosts`."""
    # Below the ephemeral range (where connections get their local ports) and above the
    # default 20000-29999 that other runs on this machine use.
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(50):
        first = rng.randrange(30000, max(30001, ephemeral - size))
        if all(port_free(host, p) for host in hosts for p in range(first, first + 10)):
            return first
    raise AssertionError(f"no free block of ports on {'/'.join(hosts)}")

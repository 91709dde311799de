"""Ports a plan binds on this machine, and a plan whose ports are all free here.

Placement hands out ports deterministically from each node's range. Two runs on one machine
(or a leftover server) would then collide, and a readiness probe could even be answered by the
other run's engine. So before anything starts, the head claims every port the plan binds on
this machine and checks it is free; if one is claimed or taken, it plans again from a range
shifted past the block. A claim is an flock on one file per port in a machine-wide folder,
held by the head until the run ends: a probe alone would leave the moment between the check
and the engine's or torchrun's own bind to a second run started at the same instant. The
kernel drops the claims of a head that dies, so none go stale.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil

from tether.placement.config import ClusterConfig
from tether.placement.plan import Plan
from tether.runtime.errors import ConfigError

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
LOCK_DIR_ENV = "TETHER_PORT_LOCK_DIR"
DEFAULT_LOCK_DIR = Path("/tmp/tether-port-claims")


def machine_addresses() -> set[str]:
    """Every address an interface of this machine holds, plus the names of loopback."""
    found = set(LOCAL_HOSTS)
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return found


class PortClaims:
    """Machine-wide claims on ports, held until `release` (or the process's end)."""

    def __init__(self, lock_dir: Path | None = None) -> None:
        self.dir = lock_dir or Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
        self._held: dict[int, int] = {}  # port -> fd holding its flock

    @property
    def ports(self) -> list[int]:
        return sorted(self._held)

    def claim(self, port: int) -> bool:
        """Claim `port` unless another process holds it; True when held by us now."""
        if port in self._held:
            return True
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o1777)  # every user's runs share the claims, like /tmp
        fd = os.open(self.dir / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[port] = fd
        return True

    def release(self) -> None:
        for fd in self._held.values():
            os.close(fd)  # closing the descriptor drops its flock
        self._held.clear()


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def local_ports(plan: Plan, here: set[str] | None = None) -> list[tuple[str, int]]:
    """(host, port) pairs the plan binds on this machine (`here`: its addresses)."""
    here = LOCAL_HOSTS if here is None else here
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
        found.extend((engine.host, port) for port in engine.dp_attention_ports)
    if plan.weight_sync is not None:
        found.append((plan.weight_sync.master_addr, plan.weight_sync.master_port))
    return sorted({(h, p) for h, p in found if h in here or h.startswith("127.")})


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
    claims: PortClaims | None = None,
    here: set[str] | None = None,
) -> Plan:
    """The plan from `cluster`, its port range moved up until every port it binds on this
    machine is free and, with `claims`, claimed by this process (held until released)."""
    first, last = cluster.node_port_first, cluster.node_port_last
    here = machine_addresses() if here is None else here
    current = cluster
    while True:
        plan = make(current)
        ports = local_ports(plan, here)
        taken: list[tuple[str, int]] = []
        if claims is not None:
            claims.release()
            # Ascending order: of two heads planning the same block, the one that claims its
            # lowest port first keeps the block; the other moves on holding nothing.
            for host, port in sorted(ports, key=lambda hp: hp[1]):
                if not claims.claim(port):
                    taken.append((host, port))
                    break
        if not taken:
            taken = [(h, p) for h, p in ports if not is_free(h, p)]
        if not taken:
            return plan
        if claims is not None:
            claims.release()
        shift = max(p for _, p in ports) + 1
        if shift + (max(p for _, p in ports) - current.node_port_first) > last:
            raise ConfigError(
                "--node-port-first",
                first,
                f"no free block of ports in {first}..{last} on this machine (taken: {taken[:4]}); "
                "widen --node-port-last or stop what holds them",
            )
        current = msgspec.structs.replace(current, node_port_first=shift)

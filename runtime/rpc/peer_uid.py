"""Which local user holds the other end of a loopback TCP connection (Linux: /proc/net/tcp[6]).

An HTTP front that must not hold a key (hooks call it as they would an unauthenticated
sglang-router) still must not serve other users of the machine: it asks the kernel's socket
table who owns the connecting socket. Written here because no kept library reads that table.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

_TABLES = {4: Path("/proc/net/tcp"), 6: Path("/proc/net/tcp6")}


def _hex_address(host: str, port: int) -> str:
    """An address as the kernel prints it: each 32-bit word of the IP in host (little-endian) order."""
    packed = ipaddress.ip_address(host).packed
    words = [packed[i : i + 4][::-1].hex().upper() for i in range(0, len(packed), 4)]
    return f"{''.join(words)}:{port:04X}"


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the socket at `peer` connected to our `local` socket on this machine;
    None where the kernel has no such table (not Linux) or the connection is not listed."""
    version = ipaddress.ip_address(peer[0]).version
    table = _TABLES[version]
    if not table.exists():
        return None
    want_local, want_remote = _hex_address(*peer[:2]), _hex_address(*local[:2])
    for line in table.read_text().splitlines()[1:]:
        fields = line.split()
        # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
        if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
            return int(fields[7])
    return None


def same_user(peer: tuple[str, int], local: tuple[str, int], uid: int) -> bool:
    """True when the socket at `peer` belongs to `uid` (also where the kernel keeps no table to
    ask: elsewhere than Linux loopback ownership cannot be told and is not refused)."""
    version = ipaddress.ip_address(peer[0]).version
    if not _TABLES[version].exists():
        return True
    return tcp_peer_uid(peer, local) == uid

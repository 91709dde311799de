"""A node's address on this machine: the interface that holds it, the environment that binds
gloo/NCCL to it, and TCP store servers listening on it alone (runtime/netif.py and its users;
the node agent binding its children: tests/integration/test_runtime_agent_binds_address.py)."""

from __future__ import annotations

import socket
from datetime import timedelta
from types import SimpleNamespace

import psutil
import torch.distributed as dist

from tether.runtime.netif import (
    GLOO_IFNAME_ENV,
    NCCL_IFNAME_ENV,
    bound_listener,
    interface_holding,
    resolve_addresses,
    socket_ifname_env,
)
from tether.runtime.weight_group import host_store
from tether.train.rank.torchrun import rendezvous_store

TABLE = {
    "lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1")],
    "eth0": [
        SimpleNamespace(family=socket.AF_PACKET, address="02:00:00:00:00:01"),
        SimpleNamespace(family=socket.AF_INET, address="192.0.2.7"),
        SimpleNamespace(family=socket.AF_INET6, address="fe80::1%eth0"),
    ],
    "ib0": [SimpleNamespace(family=socket.AF_INET6, address="fd00::7")],
}


def loopback_interface() -> str:
    name = interface_holding("127.0.0.1")
    assert name is not None
    return name


def test_interface_holding_matches_the_address_not_a_subnet() -> None:
    assert interface_holding("192.0.2.7", TABLE) == "eth0"
    assert interface_holding("fd00::7", TABLE) == "ib0"
    assert interface_holding("[fd00::7]", TABLE) == "ib0"
    assert interface_holding("fe80::1", TABLE) == "eth0"  # the scope suffix is not the address
    assert interface_holding("192.0.2.8", TABLE) is None  # a neighbour, not this machine
    # 127.0.0.2 is nobody's address, but loopback routes all of 127/8.
    assert interface_holding("127.0.0.2", TABLE) == "lo"
    assert interface_holding("no-such-host.invalid", TABLE) is None
    assert resolve_addresses("localhost")[0] in ("127.0.0.1", "::1")


def test_socket_ifname_env_names_the_interface_and_lets_the_user_win() -> None:
    lo = loopback_interface()
    assert socket_ifname_env("127.0.0.1", {}) == {GLOO_IFNAME_ENV: lo, NCCL_IFNAME_ENV: f"={lo}"}
    assert socket_ifname_env("127.0.0.1", {GLOO_IFNAME_ENV: "mine"}) == {NCCL_IFNAME_ENV: f"={lo}"}
    assert socket_ifname_env("127.0.0.1", {GLOO_IFNAME_ENV: "a", NCCL_IFNAME_ENV: "b"}) == {}
    assert socket_ifname_env("", {}) == {}  # no planned address: nothing is bound
    assert socket_ifname_env("192.0.2.250", {}) == {}  # not an address of this machine


def listening(port: int) -> set[str]:
    """Addresses this process listens on at `port`."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_bound_listener_takes_the_address_alone_or_steps_aside() -> None:
    sock = bound_listener("127.0.0.1", 0)
    assert sock is not None
    with sock:
        port = sock.getsockname()[1]
        assert listening(port) == {"127.0.0.1"}
        assert bound_listener("127.0.0.1", port) is None  # taken: the caller binds as before
    assert bound_listener("192.0.2.250", 0) is None  # not this machine's address


def test_weight_group_and_rendezvous_stores_listen_on_the_address_alone() -> None:
    store = host_store("127.0.0.1", 0, 2, timedelta(seconds=30))
    assert listening(store.port) == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store

    probe = bound_listener("127.0.0.1", 0)
    assert probe is not None
    port = probe.getsockname()[1]
    probe.close()
    flags = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    rdzv = rendezvous_store([*flags, "--node-rank=0", "-m", "tether.train.rank.worker", "--node-rank", "1"])
    assert rdzv is not None and listening(port) == {"127.0.0.1"}
    del rdzv
    assert rendezvous_store([*flags, "--node-rank=1", "-m", "x"]) is None  # not its store to host

"""Who holds the other end of a loopback connection (tether.runtime.rpc.peer_uid), and the router
front refusing connections of another user."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from tether.rollout.routing.front import RouterFront
from tether.rollout.slime_api.utils.http_utils import HTTPStatusError, get
from tether.runtime.rpc.peer_uid import same_user, tcp_peer_uid

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")


@linux_only
@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_kernel_names_our_own_uid_for_a_loopback_peer(family: int, host: str) -> None:
    with socket.socket(family) as server, socket.socket(family) as client:
        server.bind((host, 0))
        server.listen(1)
        client.connect(server.getsockname()[:2])
        accepted, peer = server.accept()
        with accepted:
            local = accepted.getsockname()[:2]
            assert tcp_peer_uid(peer[:2], local) == os.getuid()
            assert same_user(peer[:2], local, os.getuid())
            assert not same_user(peer[:2], local, os.getuid() + 1)
            # A connection the kernel does not list belongs to no one we trust.
            assert tcp_peer_uid((host, 1), local) is None
            assert not same_user((host, 1), local, os.getuid())


class _Router:
    engines = ("engine0",)


@linux_only
def test_front_refuses_another_users_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        async with RouterFront(_Router()) as front:  # type: ignore[arg-type]
            assert await get(front.url + "/health") == {}  # our own user is served
            monkeypatch.setattr(os, "getuid", lambda: 4242)  # the front now runs "as" another user
            with pytest.raises(HTTPStatusError, match="403"):
                await get(front.url + "/health")

    asyncio.run(scenario())

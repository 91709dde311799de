"""`slime.utils.http_utils`: async HTTP for hooks (`post`, `get`, `init_http_client`), on aiohttp.

Inside a rollout, requests share one aiohttp session that the rollout context owns (closed with
it); outside one, each call opens and closes its own. `post` retries as slime's does (up to
`max_retries` attempts, one second apart) on connection faults and 5xx answers, but not on a 4xx
answer: a request the server refused is wrong, and sending it again would not change that.
slime's Ray-distributed POST (`--use-distributed-post`) needs Ray and is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import msgspec

from tether.rollout.http_proxy import proxy_for
from tether.rollout.rollout_fn import RolloutContext, current_context
from tether.rollout.slime_api.finder import RayRequired

log = logging.getLogger(__name__)

_SESSION = "slime_api.http_session"
_RETRY_PAUSE = 1.0


class HTTPStatusError(RuntimeError):
    """A server answered with an error status; holds the status and the start of the body."""

    def __init__(self, url: str, status: int, body: str) -> None:
        self.url = url
        self.status = status
        self.body = body
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")


def _context() -> RolloutContext | None:
    try:
        return current_context()
    except RuntimeError:
        return None


def _new_session(limit: int = 0) -> aiohttp.ClientSession:
    # trust_env=False, as slime: internal traffic never goes through a proxy from the environment
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
    )


@contextlib.asynccontextmanager
async def _session() -> AsyncIterator[aiohttp.ClientSession]:
    ctx = _context()
    if ctx is None or ctx.loop is not asyncio.get_running_loop():
        async with _new_session() as session:
            yield session
        return
    shared: aiohttp.ClientSession | None = ctx.extensions.get(_SESSION)
    if shared is None or shared.closed:
        shared = _new_session(limit=_concurrency(ctx.args))
        ctx.extensions[_SESSION] = shared
        ctx.resources.push_async_callback(shared.close)
    yield shared


def get_rollout_num_engines(args: Any) -> int:
    """Engines behind the router: --rollout-num-gpus over --rollout-num-gpus-per-engine."""
    explicit = getattr(args, "rollout_num_engines", None)
    if explicit is not None:
        return int(explicit)
    gpus = getattr(args, "rollout_num_gpus", None) or 0
    per_engine = getattr(args, "rollout_num_gpus_per_engine", None) or 1
    return max(1, gpus // per_engine) if gpus > 0 else 0


def _concurrency(args: Any) -> int:
    per_engine = getattr(args, "sglang_server_concurrency", None) or 0
    return int(per_engine) * max(1, get_rollout_num_engines(args))


def init_http_client(args: Any) -> None:
    """slime opens its global client here; tether opens one per rollout on first use, so this only
    refuses what tether cannot do (`--use-distributed-post` needs Ray)."""
    if getattr(args, "use_distributed_post", False):
        raise RayRequired(
            "slime.utils.http_utils.init_http_client(use_distributed_post=True)", "Ray's POST actors"
        )


def _decode(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.decode("utf-8", errors="replace")


async def post(
    url: str, payload: Any = None, max_retries: int = 60, headers: Mapping[str, str] | None = None
) -> Any:
    """POST `payload` as JSON; the decoded JSON answer (or its text)."""
    attempt = 0
    body = msgspec.json.encode(payload if payload is not None else {})
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    ctx = _context()
    proxy = proxy_for(url, getattr(ctx.args, "http_proxy", None) if ctx is not None else None)
    async with _session() as session:
        while True:
            attempt += 1
            try:
                async with session.post(url, data=body, headers=hdrs, proxy=proxy) as resp:
                    raw = await resp.read()
                    if resp.status >= 400:
                        raise HTTPStatusError(url, resp.status, raw.decode("utf-8", errors="replace"))
                    return _decode(raw)
            except HTTPStatusError as exc:
                if exc.status < 500 or attempt >= max_retries:
                    raise
                log.info("POST %s: %s; retrying (%d/%d)", url, exc, attempt, max_retries)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt >= max_retries:
                    raise
                log.info("POST %s: %s; retrying (%d/%d)", url, exc, attempt, max_retries)
            await asyncio.sleep(_RETRY_PAUSE)


async def get(url: str) -> Any:
    """GET `url`; the decoded JSON answer."""
    async with _session() as session, session.get(url) as resp:
        raw = await resp.read()
        if resp.status >= 400:
            raise HTTPStatusError(url, resp.status, raw.decode("utf-8", errors="replace"))
        return _decode(raw)


def is_port_available(port: int) -> bool:
    """Whether a TCP port can be bound on every interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except (OSError, OverflowError):
            return False
        return True


def find_available_port(base_port: int) -> int:
    """The first port from `base_port` up that can be bound now."""
    port = base_port
    while not is_port_available(port):
        port += 1
        if port > 65535:
            raise OSError(f"no free port at or above {base_port}")
    return port


def get_host_info() -> tuple[str, str]:
    """(hostname, an address of this host): $SLIME_HOST_IP when set, else the hostname's address."""
    hostname = socket.gethostname()
    override = os.environ.get("SLIME_HOST_IP")
    if override:
        return hostname, override
    try:
        address = socket.gethostbyname(hostname)
    except OSError:
        address = "127.0.0.1"
    return hostname, address

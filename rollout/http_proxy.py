"""--http-proxy: the proxy for the run's calls to services outside this machine (a remote reward
model, an external rollout buffer, a hook's slime `post` to another host). Calls to loopback - the
engines, the router, local stand-ins - never take it; nor does any call without the flag (the
environment's HTTP_PROXY is not read, as slime's clients do not read it either)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from tether.runtime.errors import ConfigError

FLAG = "--http-proxy"


def check_proxy_url(url: str) -> None:
    """A proxy is an http:// or https:// URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(FLAG, url, "must be an http:// or https:// URL naming the proxy's host")


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_for(url: str, proxy: str | None) -> str | None:
    """The proxy a request to `url` goes through: `proxy`, unless `url` is on loopback."""
    return None if proxy is None or is_loopback(url) else proxy

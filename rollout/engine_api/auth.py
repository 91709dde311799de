"""The engine API key: who may steer an engine over HTTP.

Every engine a run talks to requires one key as `Authorization: Bearer <key>` (SGLang's
`--api-key`/`--admin-api-key`, the CPU engine's own check) on every endpoint but the plain
`/health` probe. The head makes a fresh key per run (or reads `--engine-api-key-file` for
engines started by someone else) and hands it to engines, the sglang-router and trainer ranks
in the environment (`TETHER_ENGINE_API_KEY`) only: a command line is visible to every user of
the machine (`ps`), and logs are copied around. Engines never get the run secret, which
authenticates tether's own RPC: they do not speak it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

from tether.runtime.rpc.secret import check_key, read_key_file

ENGINE_KEY_ENV = "TETHER_ENGINE_API_KEY"  # key_shim.py (standard library only) repeats the name


def new_engine_key() -> str:
    """A fresh random key for one run (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def run_key(key_file: str | None) -> str:
    """The engine key of one run: the one in `key_file` (--engine-api-key-file), else a fresh one."""
    return read_key_file(key_file, "--engine-api-key-file") if key_file else new_engine_key()


def key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The key in TETHER_ENGINE_API_KEY, checked; None when the variable is unset or empty."""
    env = os.environ if environ is None else environ
    text = env.get(ENGINE_KEY_ENV)
    return check_key(text, ENGINE_KEY_ENV) if text else None


def engine_env(key: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an engine process started by hand (benchmarks, tests): `base` (this
    process's environment) with the key, and without the run secret."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "TETHER_SECRET"}
    env[ENGINE_KEY_ENV] = key
    return env


def bearer_header(key: str | None) -> dict[str, str]:
    """The Authorization header that carries `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key` as a Bearer token (constant-time compare)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())

"""The per-run secret that authenticates every RPC message.

The head creates it and hands it to its children through the environment only: a command
line is visible to every user of the machine (`ps`), and logs are copied around.
"""

from __future__ import annotations

import os
import secrets

SECRET_ENV = "TETHER_SECRET"
_SECRET_BYTES = 32


def new_secret() -> bytes:
    """A fresh random secret for one run."""
    return secrets.token_bytes(_SECRET_BYTES)


def secret_to_env(secret: bytes) -> str:
    """The environment-variable form of `secret` (hex)."""
    return secret.hex()


def secret_from_env(environ: dict[str, str] | None = None) -> bytes:
    """Read the run secret from `TETHER_SECRET`; a clear error when missing or malformed."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if not text:
        raise RuntimeError(f"{SECRET_ENV} is not set: this process must be started by a tether head or agent")
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise RuntimeError(f"{SECRET_ENV} is not a hex string ({len(text)} characters)") from None
    if len(value) < 16:
        raise RuntimeError(f"{SECRET_ENV} is too short: {len(value)} bytes, need at least 16")
    return value

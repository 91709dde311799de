"""The per-run secret that authenticates every RPC message, and the checks on key files.

The head creates it and hands it to its children through the environment only: a command
line is visible to every user of the machine (`ps`), and logs are copied around.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

from tether.runtime.errors import ConfigError

SECRET_ENV = "TETHER_SECRET"
_SECRET_BYTES = 32
MIN_KEY_CHARS = 16
# An HTTP header value holds visible ASCII; a space would split "Bearer <key>" for SGLang.
_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")
_REDACTED = "<redacted>"


def new_secret() -> bytes:
    """A fresh random secret for one run."""
    return secrets.token_bytes(_SECRET_BYTES)


def secret_to_env(secret: bytes) -> str:
    """The environment-variable form of `secret` (hex)."""
    return secret.hex()


def secret_from_env(environ: dict[str, str] | None = None) -> bytes:
    """Read the run secret from `TETHER_SECRET`; a ConfigError naming it (never its value) when
    missing or malformed: an operator sets it for `tether agent`."""
    env = os.environ if environ is None else environ
    text = env.get(SECRET_ENV)
    if not text:
        raise ConfigError(
            SECRET_ENV,
            None,
            "is not set: this process must be started by a tether head or agent "
            "(`tether agent` needs the head's value in its environment)",
        )
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(
            SECRET_ENV, None, f"is not a hex string ({len(text)} characters); use the head's value"
        ) from None
    if len(value) < 16:
        raise ConfigError(SECRET_ENV, None, f"is too short: {len(value)} bytes, need at least 16")
    return value


def check_key(key: str, where: str) -> str:
    """`key` if it can serve as a Bearer token; ConfigError naming `where` (never the key) otherwise."""
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(
            where, _REDACTED, f"the key has {len(key)} characters; use at least {MIN_KEY_CHARS}"
        )
    if not _KEY_CHARS.match(key):
        raise ConfigError(where, _REDACTED, "the key must be visible ASCII characters without spaces")
    return key


def read_key_file(path: str | Path, where: str) -> str:
    """The key held in `path` (one line); refuses a file others may read or write."""
    file = Path(path)
    try:
        info = file.stat()
        text = file.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(where, str(path), f"cannot read the key file: {e}") from e
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(where, str(path), "is not a regular file")
    if info.st_mode & 0o077:
        raise ConfigError(
            where,
            str(path),
            f"is readable or writable by others (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it",
        )
    return check_key(text.strip(), where)

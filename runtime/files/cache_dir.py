"""Where tether keeps what it remembers between runs (tokenizer classes, transformers' name table).

`$TETHER_CACHE_DIR`, default `$XDG_CACHE_HOME/tether`, else `~/.cache/tether`; `TETHER_CACHE_DIR=`
(empty) turns every such cache off. Each cache is a small JSON file written atomically, and one
that is absent, unreadable or corrupt is as if empty: it only ever saves work.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TETHER_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where the caches live; None when TETHER_CACHE_DIR is set empty."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tether"

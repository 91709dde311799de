"""Run a coroutine under uvloop, the event loop tether uses everywhere."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run `main` to completion on a fresh uvloop event loop and return its result."""
    return uvloop.run(main, debug=debug)

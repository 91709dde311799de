"""Integration tests: real processes (engines, torchrun, supervisors, `tether run`) on loopback.

Every test here is `slow`, so `-m "not slow"` leaves the folder out; the files need no marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)

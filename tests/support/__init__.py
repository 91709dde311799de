"""Helpers shared by the tests (not fixtures: those are in tests/conftest.py).

Importable as `support.*` because pyproject's pytest `pythonpath` puts tests/ on sys.path.
A process a test starts that must import from here gets `PYTHONPATH` = `TESTS` (see `support_env`).
"""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent


def support_env() -> dict[str, str]:
    """Environment entries that let a child process import `support.*` (and nothing else)."""
    return {"PYTHONPATH": str(TESTS)}

"""slime's own files for tests that run them unchanged: read from the slime mirror with `git show`
(the test skips where the mirror is not at hand), written where the test says, never copied into
this tree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SLIME_GIT = Path("/work/.mirror/THUDM+slime/repo")


def slime_file(path: str, dest: Path) -> Path:
    """slime's `path` (at its newest commit here) written to `dest`."""
    if not SLIME_GIT.is_dir():
        pytest.skip(f"slime's source is not at {SLIME_GIT}")
    text = subprocess.run(
        ["git", "--git-dir", str(SLIME_GIT), "show", f"HEAD:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest

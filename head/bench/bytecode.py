"""Whether tether's own modules have current bytecode, beside every benchmark's figures.

An editable install leaves them uncompiled, and where PYTHONDONTWRITEBYTECODE is set every
process compiles each module it imports again at each start (`bin/setup` compiles them once; a
module edited since needs it again). On this project's machine that added ~0.1-0.3 s to a run's
launch-to-first-step, so a result says how many modules it was measured with uncompiled.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import tether

# tether's subpackages live in their own top-level directories (pyproject's package-dir).
SOURCE_DIRS = ("head", "runtime", "placement", "rollout", "train", "sync")


def uncompiled_modules(root: Path | None = None) -> list[str]:
    """tether's source files whose cached bytecode is missing or older than the source."""
    root = root or Path(tether.__file__).resolve().parent.parent
    found = []
    for directory in SOURCE_DIRS:
        for source in sorted((root / directory).rglob("*.py")):
            cached = Path(importlib.util.cache_from_source(str(source)))
            try:
                with open(cached, "rb") as f:
                    header = f.read(16)
                mtime = source.stat().st_mtime
            except OSError:
                found.append(str(source.relative_to(root)))
                continue
            # The header's source modification time (bytes 8-12), as the import system checks it.
            if len(header) < 16 or int.from_bytes(header[8:12], "little") != int(mtime) & 0xFFFFFFFF:
                found.append(str(source.relative_to(root)))
    return found


def note_uncompiled(result: dict[str, Any], name: str) -> dict[str, Any]:
    """`result` with `uncompiled_modules` (a count); a warning on stderr when it is not 0."""
    stale = uncompiled_modules()
    result["uncompiled_modules"] = len(stale)
    if stale:
        print(
            f"[bench {name}] {len(stale)} of tether's modules have no current bytecode (e.g. {stale[0]}): "
            "processes compile them at each start; run `bin/setup` (or compileall) before measuring",
            file=sys.stderr,
            flush=True,
        )
    return result

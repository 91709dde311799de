"""Two gloo ranks in spawned processes, each writing `err<rank>` with its traceback on failure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def run_ranks(
    target: Callable[..., None],
    args: Callable[[int], tuple[Any, ...]],
    out: Path,
    timeout: float,
    world: int = 2,
) -> list[int | None]:
    """Run `target(*args(rank))` for each rank; fail with the ranks' tracebacks; the exit codes."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args(r)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f.read_text() for f in sorted(out.glob("err*"))]
    assert not errors, "\n".join(errors)
    return [p.exitcode for p in procs]

"""Heads started at the same instant on one machine, each in its own process, claim disjoint
port blocks (tether.run.nodes.ports.PortClaims)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from support.plans import ONE_BOX as CLUSTER
from support.plans import one_box_plan as make

from tether.run.nodes.ports import PortClaims, local_ports, plan_with_free_ports


def _plan_and_hold(lock_dir: str, start: Any, ready: Any, done: Any) -> None:
    """A head in another process: plan with claims, report its ports, hold them until told."""
    start.wait()
    claims = PortClaims(Path(lock_dir))
    plan = plan_with_free_ports(CLUSTER, make, claims=claims, here={"127.0.0.1"})
    ready.put(sorted(p for _, p in local_ports(plan)))
    done.wait()
    claims.release()


def test_heads_started_at_the_same_instant_get_disjoint_ports(tmp_path: Path) -> None:
    """Four heads plan at once on one machine: each claims its block before any component
    binds it, so no two plans share a port (a probe alone would give all four the same)."""
    ctx = multiprocessing.get_context("spawn")
    start, done, ready = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_plan_and_hold, args=(str(tmp_path), start, ready, done)) for _ in range(4)]
    for proc in procs:
        proc.start()
    try:
        start.set()
        blocks = [ready.get(timeout=60) for _ in procs]
    finally:
        done.set()
        for proc in procs:
            proc.join(timeout=30)
    ports = [p for block in blocks for p in block]
    assert len(ports) == len(set(ports)), blocks
    assert all(len(block) == len(local_ports(make(CLUSTER))) for block in blocks)

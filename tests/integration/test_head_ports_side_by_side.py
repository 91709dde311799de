"""Runs started at the same instant on one machine never collide on a port.

Three `tether run`s (engines only, --debug-rollout-only) start together with the same
--node-port-first: each head claims its block before any engine binds it, so all three finish
on disjoint ports (a free-port probe alone would hand all three the same block).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.e2e import Workspace


def test_three_runs_at_once_take_disjoint_ports(ws: Workspace, tmp_path: Path) -> None:
    runs = [tmp_path / f"run{i}" for i in range(3)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TETHER_PORT_LOCK_DIR": str(tmp_path / "claims")}
    procs = []
    for run in runs:
        flags = ws.flags(run, "--num-rollout", "2", "--debug-rollout-only", "--node-port-first", "23000")
        with open(tmp_path / f"{run.name}.out", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tether", "run", *flags],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [(tmp_path / f"{run.name}.out").read_text()[-3000:] for run in runs]
    assert codes == [0, 0, 0], outputs
    ports = []
    for run in runs:
        plan = json.loads((run / "receipt.json").read_text())["plan"]
        ports += [engine["http_port"] for engine in plan["engines"]]
    assert len(ports) == len(set(ports)) == 3, ports

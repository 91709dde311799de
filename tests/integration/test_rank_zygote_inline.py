"""The rank zygote forked from the torchrun agent itself (train/rank/zygote.py `start`): in a
fresh interpreter, as `python -m tether.train.rank.torchrun` starts it, with a light module in
place of the ranks' preload (tests/support/rank_zygote_probe.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_agent_imports_once_and_forks_its_zygote_which_ends_with_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.rank_zygote_probe"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inline"], "this Python's forkserver is one the zygote knows: it must fork inline"
    # The preload ran once, in the agent; the zygote is the agent's child and a forked child
    # of the zygote finds the module without importing it again.
    assert got["marker_here"] == got["agent"]
    assert got["zygote_parent"] == got["agent"]
    assert got["child"]["parent"] == got["zygote"]
    assert got["child"]["marker_imported_by"] == got["agent"]
    assert got["exitcode"] == 0
    # Not mistaken for the agent in ps or by a test looking for it by command line.
    assert got["zygote_title"] == "tether-rank-zygote"
    # It holds what a spawned forkserver holds, not the agent's other descriptors.
    assert not got["held_in_zygote"]
    # The agent has exited: the zygote's alive pipe is closed and it ends (reaped by init).
    try:
        pidfd = os.pidfd_open(got["zygote"])
    except ProcessLookupError:
        return  # already gone
    try:
        ended, _, _ = select.select([pidfd], [], [], 30.0)  # readable once the process has exited
    finally:
        os.close(pidfd)
    assert ended, "the zygote outlived its agent"

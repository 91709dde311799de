"""The rank address files: each trainer rank writes `rank_NNNNN.json` (its RPC address) once it
serves, and the head connects when all of a job's ranks have.

Its own module, without the rank protocol's imports (numpy), because the head reads these files
while its processes start.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def write_address(directory: Path, rank: int, address: str) -> Path:
    """Write this rank's address file atomically (temp, fsync, rename, directory fsync)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank_{rank:05d}.json"
    tmp = directory / f".rank_{rank:05d}.json.tmp-{os.getpid()}"
    data = {"rank": rank, "address": address, "pid": os.getpid(), "host": socket.gethostname()}
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_addresses(directory: str | Path, world_size: int) -> dict[int, str] | None:
    """The ranks' RPC addresses once all `world_size` ranks wrote theirs, else None (poll again)."""
    found: dict[int, str] = {}
    for rank in range(world_size):
        path = Path(directory) / f"rank_{rank:05d}.json"
        if not path.is_file():
            return None
        found[rank] = str(json.loads(path.read_text())["address"])
    return found

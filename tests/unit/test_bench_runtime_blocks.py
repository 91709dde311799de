"""`tether bench runtime` takes round trips in alternating blocks, so that tether (or Ray) and
the floors it is compared with are measured in the same seconds."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from tether.bench.runtime.floors import RTT_BLOCKS, EchoClient, interleaved_round_trips


class _Recorder:
    """Stands in for an echo process: records when each block ran and how long it was."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        self.name, self.log = name, log

    def round_trips(self, n: int) -> list[float]:
        self.log.append((self.name, n))
        return [float(len(self.log))] * n


def test_blocks_alternate_and_every_side_gets_all_its_calls() -> None:
    log: list[tuple[str, int]] = []
    echoes = {name: cast(EchoClient, _Recorder(name, log)) for name in ("raw_pyzmq", "raw_unix_socket")}

    async def own(n: int) -> list[float]:
        log.append(("own", n))
        return [0.5] * n

    calls = 10 * RTT_BLOCKS + 3  # not a multiple: the first blocks take one more
    out = asyncio.run(interleaved_round_trips(own, echoes, calls))

    assert {name: len(times) for name, times in out.items()} == dict.fromkeys(
        ("own", "raw_pyzmq", "raw_unix_socket"), calls
    )
    # floor, floor, own, floor, floor, own, ...: never two blocks of one side in a row
    assert [name for name, _ in log] == ["raw_pyzmq", "raw_unix_socket", "own"] * RTT_BLOCKS
    sizes = [n for name, n in log if name == "own"]
    assert sizes == [11, 11, 11] + [10] * (RTT_BLOCKS - 3)
    assert all(n == sizes[i // 3] for i, (_, n) in enumerate(log))


def test_fewer_calls_than_blocks_still_alternates() -> None:
    log: list[tuple[str, int]] = []
    echoes: dict[str, Any] = {"raw_pyzmq": _Recorder("raw_pyzmq", log)}

    async def own(n: int) -> list[float]:
        log.append(("own", n))
        return [0.5] * n

    out = asyncio.run(interleaved_round_trips(own, echoes, 3))
    assert log == [("raw_pyzmq", 1), ("own", 1)] * 3
    assert len(out["own"]) == len(out["raw_pyzmq"]) == 3

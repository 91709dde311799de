"""Unit tests: one process, no children. Any attempt to start a process here fails loudly.

While a unit test is set up, run and torn down (its fixtures included), every way Python starts a
process raises: subprocess (and so asyncio's subprocesses, os.popen), os.fork/forkpty,
os.posix_spawn*, os.system, os.exec*/spawn*, multiprocessing's spawn and fork (torch.multiprocessing
too). A test that needs a process belongs in tests/integration/.
"""

from __future__ import annotations

import asyncio
import multiprocessing.popen_fork
import multiprocessing.util
import os
import subprocess
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


class ProcessStartInUnitTest(AssertionError):
    """A unit test tried to start a process."""


def _refuse(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ProcessStartInUnitTest(
            f"{what} in a unit test: tests under tests/unit/ start no process; "
            "move this test to tests/integration/"
        )

    return refuse


def _targets() -> list[tuple[Any, str]]:
    targets: list[tuple[Any, str]] = [
        (subprocess.Popen, "_execute_child"),
        (multiprocessing.util, "spawnv_passfds"),
        (multiprocessing.popen_fork.Popen, "_launch"),
        (asyncio, "create_subprocess_exec"),
        (asyncio, "create_subprocess_shell"),
        (asyncio.subprocess, "create_subprocess_exec"),
        (asyncio.subprocess, "create_subprocess_shell"),
        (asyncio.base_events.BaseEventLoop, "subprocess_exec"),
        (asyncio.base_events.BaseEventLoop, "subprocess_shell"),
    ]
    names = ["fork", "forkpty", "posix_spawn", "posix_spawnp", "system"]
    names += [n for n in dir(os) if n.startswith(("exec", "spawn"))]
    targets += [(os, n) for n in names if hasattr(os, n)]
    return targets


@contextmanager
def no_processes() -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name in _targets()]
    try:
        for owner, name, original in saved:
            what = f"{getattr(owner, '__name__', owner)}.{name}"
            refuse = _refuse(what)
            if isinstance(original, staticmethod | classmethod):
                refuse = type(original)(refuse)
            setattr(owner, name, refuse)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _guarded(item: pytest.Item) -> Generator[None, Any, Any]:
    if not item.path.is_relative_to(HERE):
        return (yield)
    with no_processes():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    return (yield from _guarded(item))

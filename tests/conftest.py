"""Fixtures shared by every test folder: free ports, the tiny model, CPU engines, workspaces.

The layers: tests/unit/ starts no process (its conftest makes any attempt fail), tests/integration/
starts real processes on loopback (its conftest marks every test `slow`), tests/gpu/ needs CUDA.
Helpers that are not fixtures live in tests/support/ (importable as `support.*`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import net
from support.e2e import Workspace, make_workspace
from support.engines import SLOW_ENGINE, Engine, EngineFactory, start_cpu_engine, stop_engine
from support.sdnotify import NotifySocket

from tether.runtime.files.cache_dir import CACHE_ENV


def pytest_configure(config: pytest.Config) -> None:
    """The tests' own cache directory (tokenizer classes: tether.rollout.data.tokenizer_choice),
    for this process and every run it starts, never the user's; removed at the end."""
    if CACHE_ENV not in os.environ:
        path = tempfile.mkdtemp(prefix="tether-test-cache-")
        os.environ[CACHE_ENV] = path
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))


@pytest.fixture
def free_port() -> int:
    """A port free on 127.0.0.1 (`support.net.free_port()` where a test needs several)."""
    return net.free_port()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama checkpoint (`tether init-model`'s), written once; tests only read it."""
    from tether.rollout.cpu_engine.modeling.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "llama")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Where a test's run keeps its files (not created: `tether run` makes it)."""
    return tmp_path / "run"


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    """An end-to-end workspace (tiny model, demo prompts, `flags()` for `tether run`), one per module."""
    return make_workspace(tmp_path_factory.mktemp("ws"))


@pytest.fixture
def cpu_engine(tiny_model: Path, tmp_path: Path) -> Iterator[EngineFactory]:
    """Start CPU engines the product's way, all stopped when the test ends.

    `cpu_engine(*extra, model=tiny_model, module=..., api_key=..., allow_nonfinite_weights=...)`:
    the command line and environment come from tether.rollout.engine_api.launch's `build_launch`
    (a one-process engine on 127.0.0.1, free ports), `extra` appended; returns the healthy engine.
    """
    with contextlib.ExitStack() as started:

        def start(*extra: str, model: str | Path = tiny_model, **kwargs: Any) -> Engine:
            engine = start_cpu_engine(model, tmp_path, *extra, **kwargs)
            started.callback(stop_engine, engine)
            return engine

        yield start


@pytest.fixture
def slow_engine(cpu_engine: EngineFactory) -> EngineFactory:
    """`cpu_engine` running tether.bench.engines.slow_engine: pass `delay_argv(...)` among the flags."""

    def start(*extra: str, **kwargs: Any) -> Engine:
        return cpu_engine(*extra, module=SLOW_ENGINE, **kwargs)

    return start


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET, recording what arrives."""
    with NotifySocket(tmp_path / "notify.sock") as sock:
        yield sock

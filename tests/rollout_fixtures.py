"""Shared helpers for the rollout tests: a tiny model, real CPU engine processes, configs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine_fixtures import key_env

from tether.config import Config
from tether.rollout.config import DataConfig, RolloutConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(out: Path) -> Path:
    from tether.rollout.cpu_engine.tiny_model import write_tiny_model

    return write_tiny_model(out)


@contextmanager
def cpu_engine(
    model: Path,
    log_dir: Path,
    extra: Sequence[str] = (),
    ready_s: float = 120.0,
    module: str = "tether.rollout.cpu_engine",
) -> Iterator[str]:
    """A real `python -m tether.rollout.cpu_engine` process on a free port, requiring ENGINE_KEY;
    yields its URL."""
    port = free_port()
    log_path = log_dir / f"engine-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                "--model-path",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--weight-version",
                "0",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=key_env(),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine not ready in {ready_s}s: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)  # polling a subprocess's readiness with a deadline
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group of the process we started, by its id
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def make_config(rollout: dict[str, Any] | None = None, data: dict[str, Any] | None = None) -> Config:
    return Config(rollout=RolloutConfig(**(rollout or {})), data=DataConfig(**(data or {})))

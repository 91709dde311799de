"""CPU engines for the benchmarks: started on free loopback ports, ready before use, stopped after."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from tether.rollout.engine_api.auth import engine_env
from tether.rollout.engine_api.client import EngineClient

CPU_ENGINE = "tether.rollout.cpu_engine"
READY_S = 120.0


def free_port() -> int:
    """A port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def cpu_engines(
    model: str | Path,
    key: str,
    count: int = 1,
    *,
    module: str = CPU_ENGINE,
    extra: Callable[[int], Sequence[str]] = lambda i: (),
    log_dir: Path | None = None,
) -> AsyncIterator[list[str]]:
    """`count` engine processes serving `model`, each answering /health; yields their URLs.

    `module` is the CPU engine or tether.bench.engines.slow_engine; `extra(i)` adds engine i's flags.
    Logs go to `log_dir`/engine-<i>.log when given (else nowhere). Every engine is stopped on exit.
    """
    from tether.rollout.cpu_engine.server import check_model_path

    check_model_path(str(model))  # one line naming --model-path, not an engine that exits at load
    procs: list[asyncio.subprocess.Process] = []
    urls: list[str] = []
    try:
        for i in range(count):
            port = free_port()
            argv = [sys.executable, "-m", module, "--model-path", str(model), "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--weight-version", "0", *extra(i)]
            out = await asyncio.to_thread(open, log_dir / f"engine-{i}.log", "wb") if log_dir else None
            try:
                procs.append(
                    await asyncio.create_subprocess_exec(
                        *argv,
                        stdout=out or asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True,
                        env=engine_env(key),
                    )
                )
            finally:
                if out is not None:
                    out.close()  # the child holds its own copy
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            async with EngineClient(url, api_key=key) as client, asyncio.timeout(READY_S):
                while not await client.health():
                    if proc.returncode is not None:  # set by the loop when the child exits
                        where = f"; see {log_dir}" if log_dir else ""
                        raise RuntimeError(
                            f"engine {url} exited with {proc.returncode} before it was ready{where}"
                        )
                    await asyncio.sleep(0.2)  # polling under a deadline
        yield urls
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()

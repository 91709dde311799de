"""Helpers for tests that drive engines over HTTP: start an engine the product's way (the
command line and environment from tether.rollout.engine_api.launch's `build_launch`, run as a
process of the test's own, or either backend under tether's Supervisor), a tiny JSON client, and
transformers references for greedy tokens and log-probs. The `cpu_engine` and `slow_engine`
fixtures in tests/conftest.py use these.

Every engine requires an API key; the engines tests start take ENGINE_KEY (as a run's head
makes one), and `Engine` and `engine_client` send it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import torch

from support.net import free_port
from tether.placement.plan import DeviceKind, EnginePart
from tether.placement.plan import Engine as PlanEngine
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV, bearer_header, engine_env, new_engine_key
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.engine_api.launch import (
    DEFAULT_SGLANG_VENV,
    SGLANG_PYTHON_ENV,
    SGLANG_VENV_ENV,
    EngineLaunch,
    EngineLaunchConfig,
    build_launch,
    start_engine,
)
from tether.runtime.loop import run
from tether.runtime.process.supervisor import Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret

ENGINE_KEY = new_engine_key()
"""The key of every engine the tests start (one per test session)."""

EngineFactory = Callable[..., "Engine"]
"""The `cpu_engine` and `slow_engine` fixtures: call with extra flags (and keywords) to start one."""

CPU_ENGINE = "tether.rollout.cpu_engine"
SLOW_ENGINE = "tether.bench.engines.slow_engine"
"""The CPU engine with a per-request delay; takes the CPU engine's flags plus `delay_argv(...)`."""


def key_env() -> dict[str, str]:
    """This process's environment with ENGINE_KEY, for an engine process started by a test."""
    return engine_env(ENGINE_KEY)


def write_key(path: Path, text: str, mode: int = 0o600) -> Path:
    """A key file holding `text` with permissions `mode` (a loose mode makes a refused one)."""
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def engine_client(url: str, **kwargs: Any) -> EngineClient:
    """tether's engine client, sending ENGINE_KEY."""
    return EngineClient(url, api_key=ENGINE_KEY, **kwargs)


@dataclass
class Engine:
    """A running engine: base URL, model directory, process (None for external engines)."""

    url: str
    model_path: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    kind: str = "cpu"
    api_key: str | None = ENGINE_KEY
    launch: EngineLaunch | None = None
    """What tether's launcher built for it (argv, environment, URL), to start it again."""
    """Sent as `Authorization: Bearer`; `dataclasses.replace(engine, api_key=None)` is a stranger."""

    def request(
        self, path: str, payload: Any = None, method: str = "POST", timeout: float = 60
    ) -> tuple[int, Any]:
        data = (
            None
            if payload is None
            else (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for name, value in bearer_header(self.api_key).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def post(self, path: str, payload: Any = None, timeout: float = 60) -> Any:
        status, body = self.request(path, payload if payload is not None else {}, timeout=timeout)
        assert status == 200, f"{path} -> {status}: {body}"
        return body

    def get(self, path: str) -> Any:
        status, body = self.request(path, method="GET")
        assert status == 200, f"{path} -> {status}: {body}"
        return body

    def stream(self, payload: dict[str, Any], timeout: float = 60, path: str = "/generate") -> list[Any]:
        """The events of a streamed request: each `data:` line's JSON, and "[DONE]"."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        for name, value in bearer_header(self.api_key).items():
            req.add_header(name, value)
        events: list[Any] = []
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                line = line.strip()
                if line.startswith(b"data: "):
                    body = line[len(b"data: ") :]
                    events.append("[DONE]" if body == b"[DONE]" else json.loads(body))
        return events


def cpu_engine_launch(
    model_path: str | os.PathLike[str],
    *extra: str,
    module: str = CPU_ENGINE,
    index: int = 0,
    api_key: str | None = ENGINE_KEY,
    allow_nonfinite_weights: bool = False,
    ready_timeout: float = 120.0,
) -> EngineLaunch:
    """The launch tether's head builds for a one-process CPU engine on 127.0.0.1 (free ports),
    with `module` in place of the CPU engine (the slow engine takes the same flags) and `extra`
    appended to its command line."""
    cfg = EngineLaunchConfig(
        model_path=os.fspath(model_path),
        backend="cpu",
        device_kind="cpu",
        ready_timeout=ready_timeout,
        api_key=api_key,
        allow_nonfinite_weights=allow_nonfinite_weights,
    )
    launch = build_launch(local_plan_engine(index), cfg)
    (spec,) = launch.specs
    argv = list(spec.argv)
    assert argv[1:3] == ["-m", CPU_ENGINE], argv
    argv[2] = module
    spec = msgspec.structs.replace(spec, argv=[*argv, *extra])
    return msgspec.structs.replace(launch, specs=[spec])


def spawn(launch: EngineLaunch, log: Path) -> subprocess.Popen[bytes]:
    """Start a launch's (one) process as the node agent would: this environment without the run
    secret or an inherited engine key, the spec's laid over it; its own session, output to `log`."""
    (spec,) = launch.specs
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, ENGINE_KEY_ENV)}
    env.update(spec.env)
    with open(log, "ab") as out:
        return subprocess.Popen(
            spec.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(engine: Engine, deadline_s: float = 120) -> Engine:
    """Poll the engine's /health until it answers 200; fail with the log's tail if it exits first."""
    proc = engine.proc
    tail = lambda: engine.log.read_text()[-3000:] if engine.log else ""  # noqa: E731
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{tail()}")
        try:
            if engine.request("/health", method="GET", timeout=2)[0] == 200:
                return engine
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # polling with a deadline, not standing in for synchronisation
    stop_engine(engine)
    raise RuntimeError(f"engine not ready in {deadline_s}s:\n{tail()}")


def prepared_cpu_engine(model_path: str | os.PathLike[str], log: Path, *extra: str, **launch: Any) -> Engine:
    """A CPU engine built by `cpu_engine_launch`, not started: `launch_engine` starts it (again)."""
    built = cpu_engine_launch(model_path, *extra, **launch)
    return Engine(
        url=built.url, model_path=os.fspath(model_path), log=log, launch=built, api_key=built.api_key
    )


def launch_engine(engine: Engine, deadline_s: float = 120) -> Engine:
    """Start a prepared engine's process (on its port, with its flags) and wait until it is healthy."""
    assert engine.launch is not None and engine.log is not None
    engine.proc = spawn(engine.launch, engine.log)
    return wait_healthy(engine, deadline_s)


def start_cpu_engine(
    model_path: str | os.PathLike[str],
    log_dir: Path,
    *extra: str,
    deadline_s: float = 120,
    module: str = CPU_ENGINE,
    **launch: Any,
) -> Engine:
    """A CPU engine (or `module`) process serving `model_path`, healthy; stop it with `stop_engine`.
    `launch` goes to `cpu_engine_launch` (api_key, allow_nonfinite_weights, index)."""
    engine = prepared_cpu_engine(model_path, log_dir / "engine.log", *extra, module=module, **launch)
    engine.log = log_dir / f"engine-{engine.url.rsplit(':', 1)[1]}.log"  # one per engine in a folder
    return launch_engine(engine, deadline_s)


def stop_engine(engine: Engine) -> None:
    """SIGTERM to the engine (its own clean stop), SIGKILL to its process group after 10 s."""
    proc = engine.proc
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group of the process we started, by its id
        proc.wait(timeout=10)


@contextlib.contextmanager
def cpu_engine(
    model_path: str | os.PathLike[str], log_dir: Path, *extra: str, **kwargs: Any
) -> Iterator[Engine]:
    """`start_cpu_engine` for a with-block (module-scoped fixtures); stopped when it ends."""
    engine = start_cpu_engine(model_path, log_dir, *extra, **kwargs)
    try:
        yield engine
    finally:
        stop_engine(engine)


def wait_until(predicate: Any, deadline_s: float = 30, what: str = "condition") -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@cache
def _hf_model(model_dir: str) -> Any:
    from support.hf_reference import load_causal_lm

    return load_causal_lm(model_dir)


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of `prompt` by transformers (no EOS stop) and each token's log-prob."""
    model = _hf_model(model_dir)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        full = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = ids[len(prompt) :]
    lps = [float(full[len(prompt) - 1 + j, tok]) for j, tok in enumerate(out)]
    return out, lps


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids` (row i predicts token i + 1)."""
    model = _hf_model(model_dir)
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_routed_experts(model_dir: str, ids: list[int]) -> dict[int, torch.Tensor]:
    """The experts transformers' router of each MoE layer picks for every position of `ids`
    ({layer: [len(ids), top_k]}, each row sorted: the order within a token's top-k means nothing)."""
    model = _hf_model(model_dir)
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if (
            type(module).__name__.lower().endswith("router")
        ):  # Qwen/Mixtral TopKRouter, DeepSeek/GLM TopkRouter
            parts = name.split(".")  # model.layers.{i}... (model.language_model.layers.{i}... in Qwen3.5)
            layer = int(parts[parts.index("layers") + 1])
            hooks.append(
                module.register_forward_hook(
                    lambda _m, _i, out, layer=layer: got.__setitem__(layer, out[2].view(len(ids), -1))
                )
            )
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: picked.sort(-1).values for layer, picked in got.items()}


def decode_routed_experts(meta: dict[str, Any], layers: int, topk: int) -> torch.Tensor:
    """`meta_info.routed_experts` (base64 of int32 [rows, layers, top_k], SGLang's encoding)."""
    raw = base64.b64decode(meta["routed_experts"])
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, layers, topk)


def make_models(root: Path) -> tuple[str, str]:
    """Two tiny Llama checkpoints with the same shapes and different weights (v1, v2)."""
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    v1 = write_tiny_model(root / "v1", TinyModelSpec(seed=0))
    v2 = write_tiny_model(root / "v2", TinyModelSpec(seed=1))
    return os.fspath(v1), os.fspath(v2)


def find_sglang_python() -> tuple[str | None, str]:
    """The python of the real-SGLang venv, or None and what is missing (for a skip message)."""
    explicit = os.environ.get(SGLANG_PYTHON_ENV)
    if explicit:
        if Path(explicit).exists():
            return explicit, ""
        return None, f"${SGLANG_PYTHON_ENV}={explicit} does not exist"
    venv = Path(os.environ.get(SGLANG_VENV_ENV) or DEFAULT_SGLANG_VENV)
    if not (venv / ".tether-stamp").exists() or not (venv / "bin" / "python").exists():
        return (
            None,
            f"the SGLang venv {venv} is not built (run tests/support/sglang_env.sh, or set ${SGLANG_PYTHON_ENV})",
        )
    return str(venv / "bin" / "python"), ""


def local_plan_engine(index: int = 0, *, tp_size: int = 1, **fields: Any) -> PlanEngine:
    """A one-process engine on 127.0.0.1 with free ports, shaped as the placement plan makes it."""
    http_port, nccl_port, dist_port = free_port(), free_port(), free_port()
    values: dict[str, Any] = {
        "index": index,
        "group": "default",
        "worker_type": "regular",
        "external": False,
        "tp_size": tp_size,
        "host": "127.0.0.1",
        "http_port": http_port,
        "address": f"127.0.0.1:{http_port}",
        "nccl_port": nccl_port,
        "dist_init_addr": f"127.0.0.1:{dist_port}",
        "nnodes": 1,
        "parts": [
            EnginePart(
                node=0, hostname="localhost", node_rank=0, devices=[0], cuda_visible_devices=None, env={}
            )
        ],
        "weight_sync_rank_offset": None,
    }
    values.update(fields)
    return PlanEngine(**values)


class SupervisedEngine:
    """An engine started by tether's launcher under a Supervisor, whose event loop runs in a thread.

    Synchronous tests talk to it over HTTP; `close()` leaves the supervisor block, which stops
    the engine (SIGTERM, grace, SIGKILL to its process group).
    """

    def __init__(self, run_dir: Path, plan_engine: PlanEngine, cfg: EngineLaunchConfig) -> None:
        self.run_dir = run_dir
        self.launch = build_launch(plan_engine, cfg)
        self._ready: Future[None] = Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name=f"supervisor-{self.launch.name}", daemon=True)

    def _main(self) -> None:
        try:
            run(self._serve())
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._task = asyncio.current_task()
        async with Supervisor(self.run_dir, new_secret(), grace=10.0) as sup:
            await start_engine(sup, self.launch)
            self._ready.set_result(None)
            await self._stop.wait()

    def start(self, timeout: float) -> None:
        self._thread.start()
        self._ready.result(timeout=timeout)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            if self._ready.done():
                self._loop.call_soon_threadsafe(self._stop.set)
            elif self._task is not None:  # still starting: cancelling leaves the supervisor block too
                self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=60)

    @property
    def log(self) -> Path:
        return self.run_dir / "logs" / f"{self.launch.specs[-1].name}.log"


def start_supervised(
    kind: str,
    model_path: str,
    run_dir: Path,
    *,
    sglang_python: str | None = None,
    sglang_args: list[str] | None = None,
    ready_timeout: float = 240,
    device_kind: DeviceKind = "cpu",
    offload: bool = False,
) -> tuple[Engine, Callable[[], None]]:
    """Start a `cpu` or `sglang` engine through the launcher; returns the client and its stopper.
    `device_kind="gpu"` with `offload=True` is a colocated engine (SGLang's memory saver on)."""
    cfg = EngineLaunchConfig(
        model_path=model_path,
        backend="sglang" if kind == "sglang" else "cpu",
        device_kind=device_kind,
        offload=offload,
        sglang_python=sglang_python,
        sglang_args=list(sglang_args or []),
        ready_timeout=ready_timeout,
        api_key=ENGINE_KEY,
    )
    supervised = SupervisedEngine(run_dir, local_plan_engine(), cfg)
    try:
        supervised.start(timeout=ready_timeout + 60)
    except BaseException:
        supervised.close()
        raise
    return Engine(
        url=supervised.launch.url, model_path=model_path, log=supervised.log, kind=kind
    ), supervised.close


# Tiny models of these families get four layers, so both kinds of layer are served (and split at
# PP=2): those keeping layer 0 dense (first_k_dense_replace=1), and linear- and full-attention layers.
FAMILY_LAYERS = {
    "deepseek_v3": 4,
    "glm4_moe": 4,
    "glm4_moe_lite": 4,
    "kimi_k2": 4,
    "qwen3_next": 4,
    "qwen3_5": 4,
    "qwen3_5_moe": 4,
    # GLM-5 with 4 layers: indexers on layers 0, 1 and 3, layer 2 sharing layer 1's (init-model's default).
    "glm_moe_dsa": 4,
    "deepseek_v32": 4,
}

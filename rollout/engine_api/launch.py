"""How one rollout engine is started: argv, environment and readiness probe, for either backend.

`--rollout-engine sglang` runs `python -m sglang.launch_server` (the python of the SGLang venv),
`--rollout-engine cpu` runs tether's embedded engine; both speak SGLang's HTTP API, so one client
and one readiness probe (GET /health_generate) serve both.

Both require the run's engine key (`EngineLaunchConfig.api_key`, see engine_auth.py) on every
endpoint but `/health`. It reaches the process in its environment only, never in argv: SGLang
reads `--api-key`/`--admin-api-key` from its command line, so it starts through key_shim.py,
which moves the key from the environment into its own `sys.argv` and runs
`sglang.launch_server` (what `ps` shows is the argv the process was started with) and redacts
the key from SGLang's logs. Engines get the engine key and not the run secret
(`ProcessSpec.run_secret`). An embedded engine on a CPU plan is forked from its node's
secret-less zygote (`ProcessSpec.zygote`, `tether.rollout.cpu_engine.preload`): the first start
pays its imports as a spawn would, every later engine of the node (and every restart) starts at
its model load.

    launch_cfg = EngineLaunchConfig.from_config(cfg.rollout, cfg.fault_tolerance, cfg.sglang_args, plan)
    launch = build_launch(engine, launch_cfg, node_name=lambda part: nodes[part.hostname])
    procs = await start_engine(supervisor, launch)   # ready, or ActorDied with the log tail

SGLang's server arguments are layered, later layers winning: the placement plan's own flags
(host, port, --tp-size, --nccl-port, --dist-init-addr, --nnodes/--node-rank), CPU defaults on a
CPU plan (--device cpu, the torch-native attention backend, a small KV cache), every `--sglang-*`
pass-through flag, then the engine group's `overrides` from --sglang-config. The plan's flags
cannot be overridden: ports and sizes come from placement (change the cluster flags instead).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from tether.placement.plan import Engine, EnginePart, Plan
from tether.placement.server_groups import OverrideValue
from tether.rollout.config import RolloutConfig
from tether.rollout.engine_api import key_shim as key_shim_file
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV, bearer_header
from tether.runtime.config import FaultToleranceConfig
from tether.runtime.errors import ConfigError
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import ManagedProcess, Supervisor
from tether.runtime.process.zygote_client import SECRETLESS_ZYGOTE_ENV

log = logging.getLogger(__name__)

EngineBackend = Literal["sglang", "cpu"]
DeviceKind = Literal["gpu", "cpu"]

SGLANG_PYTHON_ENV = "TETHER_SGLANG_PYTHON"
"""Environment variable naming the python that runs SGLang (a venv's bin/python)."""
SGLANG_VENV_ENV = "TETHER_SGLANG_VENV"
"""Environment variable naming the SGLang venv that tests/support/sglang_env.sh builds."""
DEFAULT_SGLANG_VENV = Path.home() / ".cache" / "tether" / "sglang-venv"
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
CPU_ENGINE_PRELOAD = "tether.rollout.cpu_engine.preload"
FORK_ENGINES_ENV = "TETHER_FORK_ENGINES"

# Flags the placement plan sets; a user value would break port and device bookkeeping.
PLAN_FLAGS: dict[str, str] = {
    "model-path": "--hf-checkpoint",
    "model": "--hf-checkpoint",
    "host": "the cluster inventory (node addresses)",
    "port": "--node-port-first/--node-port-last",
    "tp-size": "--rollout-num-gpus-per-engine",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "nccl-port": "--node-port-first/--node-port-last",
    "dist-init-addr": "the placement plan",
    "nnodes": "--rollout-num-gpus-per-engine with --rollout-engines-may-span-nodes",
    "node-rank": "the placement plan",
    "api-key": "--engine-api-key-file (every engine gets the run's engine key)",
    "admin-api-key": "--engine-api-key-file (every engine gets the run's engine key)",
}


def key_shim(module: str, key_flags: Sequence[str]) -> list[str]:
    """What follows the python in argv to run `module` with `key_flags` set to the engine key
    from the environment (see key_shim.py; the key never appears in the command line)."""
    return [key_shim_file.__file__, module, ",".join(key_flags)]


# SGLang on CPU (SGLANG_USE_CPU_ENGINE=1): the torch-native attention backend is the one that runs
# there, and without a cap the KV cache reserves ~15 GB; 32768 tokens keep a server near 3 GB.
SGLANG_CPU_DEFAULTS: dict[str, list[str]] = {
    "device": ["cpu"],
    "attention-backend": ["torch_native"],
    "max-total-tokens": ["32768"],
}

# SGLang flags the CPU engine understands with the same meaning; other SGLang tuning is dropped.
CPU_ENGINE_FLAGS = frozenset(
    {
        "context-length",
        "max-running-requests",
        "random-seed",
        "weight-version",
        "served-model-name",
        "tool-call-parser",
        "enable-return-routed-experts",
        "dtype",  # on --device cuda, as SGLang reads it (auto: float16 for a float32 checkpoint)
    }
)

# `--sglang-router-<flag>` configures the sglang-router process (SGLang has no --router-* flag).
ROUTER_PREFIX = "router-"

Flags = dict[str, list[str]]
"""Ordered flag name (without dashes) → its values; a switch has no values."""


class EngineLaunchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The engine-related settings of a run, resolved once before any engine starts."""

    model_path: str
    backend: EngineBackend = "sglang"
    device_kind: DeviceKind = "gpu"
    sglang_args: list[str] = msgspec.field(default_factory=list)
    """Pass-through SGLang flags, already without the `--sglang-` prefix (`--mem-fraction-static 0.7`)."""
    sglang_python: str | None = None
    """Python that runs SGLang; None: $TETHER_SGLANG_PYTHON, else the cached venv, else this python."""
    ready_timeout: float = 300.0
    """--rollout-health-check-first-wait: how long an engine may take to answer /health_generate."""
    offload: bool = False
    """The plan offloads rollout memory (colocated): SGLang needs --enable-memory-saver."""
    api_key: str | None = None
    """The engine key every engine requires (given in its environment); None: SGLang starts
    without one, and the CPU engine refuses to start."""
    allow_nonfinite_weights: bool = False
    """CPU engine: accept weight updates holding NaN or inf (SGLang has no such check)."""
    return_routed_experts: bool = False
    """--use-rollout-routing-replay: engines record each token's routed experts
    (`--enable-return-routed-experts`, which slime also sets on SGLang for it)."""

    def __repr__(self) -> str:
        # The key stays out of logs and tracebacks that show this config.
        shown = msgspec.structs.replace(self, api_key=None if self.api_key is None else "<redacted>")
        fields = ", ".join(f"{f}={getattr(shown, f)!r}" for f in self.__struct_fields__)
        return f"EngineLaunchConfig({fields})"

    @classmethod
    def from_config(
        cls,
        rollout: RolloutConfig,
        fault_tolerance: FaultToleranceConfig,
        sglang_args: Sequence[str],
        plan: Plan,
        sglang_python: str | None = None,
        api_key: str | None = None,
        return_routed_experts: bool = False,
    ) -> EngineLaunchConfig:
        if rollout.hf_checkpoint is None:
            raise ConfigError("--hf-checkpoint", None, "engines need a model directory to serve")
        return cls(
            model_path=rollout.hf_checkpoint,
            backend=rollout.rollout_engine,
            device_kind=plan.device_kind,
            sglang_args=list(sglang_args),
            sglang_python=sglang_python,
            # Loading can take long (compiling, big weights): first-wait is the start-up grace.
            ready_timeout=fault_tolerance.rollout_health_check_first_wait or 600.0,
            offload=plan.offload_rollout,
            api_key=api_key,
            allow_nonfinite_weights=rollout.engine_allow_nonfinite_weights,
            return_routed_experts=return_routed_experts,
        )


class EngineLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to start one engine and know it is serving."""

    name: str
    url: str
    """Base URL clients use, http://host:port."""
    specs: list[ProcessSpec]
    """One process per node; followers (node rank > 0) first, the HTTP-serving head last."""
    ready_timeout: float
    worker_type: str = "regular"
    bootstrap_port: int | None = None
    """For a prefill engine: its disaggregation bootstrap port (the router needs it)."""
    api_key: str | None = None
    """The key the engine requires (the readiness probe sends it)."""

    def __repr__(self) -> str:
        return f"EngineLaunch(name={self.name!r}, url={self.url!r}, worker_type={self.worker_type!r})"


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("_", "-")


def parse_flags(args: Sequence[str], where: str) -> Flags:
    """`["--a", "1", "--b", "--c=x"]` → `{"a": ["1"], "b": [], "c": ["x"]}`; a later repeat wins."""
    flags: Flags = {}
    current: str | None = None
    for token in args:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            current = _key(name)
            flags.pop(current, None)  # re-insert so the last occurrence decides the order too
            flags[current] = [value] if eq else []
        elif current is None:
            raise ConfigError(where, token, "expected a --flag before this value")
        else:
            flags[current].append(token)
    return flags


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def override_flags(overrides: Mapping[str, OverrideValue], where: str) -> dict[str, list[str] | None]:
    """A server group's `overrides` as flags: true → switch, false/null → flag removed, list → values."""
    out: dict[str, list[str] | None] = {}
    for raw_key, value in overrides.items():
        key = _key(raw_key)
        if not key:
            raise ConfigError(f"{where}.overrides", raw_key, "is not a flag name")
        if value is True:
            out[key] = []
        elif value is False or value is None:
            out[key] = None
        elif isinstance(value, list):
            out[key] = [_value(v) for v in value]
        else:
            out[key] = [_value(value)]
    return out


def _check_not_plan_owned(keys: Sequence[str], where: str) -> None:
    for key in keys:
        if key in PLAN_FLAGS:
            raise ConfigError(
                where, f"--{key}", f"is set by the placement plan; use {PLAN_FLAGS[key]} instead"
            )


def engine_passthrough(sglang_args: Sequence[str]) -> Flags:
    """The pass-through flags meant for the engine: all but `--sglang-router-*` (those go to the router)."""
    flags = parse_flags(sglang_args, "--sglang-*")
    engine = {k: v for k, v in flags.items() if not k.startswith(ROUTER_PREFIX)}
    _check_not_plan_owned(list(engine), "--sglang-*")
    return engine


def flags_to_argv(flags: Flags) -> list[str]:
    argv: list[str] = []
    for key, values in flags.items():
        argv += [f"--{key}", *values]
    return argv


def sglang_python(explicit: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The python that runs SGLang: explicit, $TETHER_SGLANG_PYTHON, the cached venv, or this python."""
    if explicit:
        return explicit
    if environ.get(SGLANG_PYTHON_ENV):
        return environ[SGLANG_PYTHON_ENV]
    venv = Path(environ.get(SGLANG_VENV_ENV) or DEFAULT_SGLANG_VENV)
    candidate = venv / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


def sglang_flags(engine: Engine, part: EnginePart, cfg: EngineLaunchConfig) -> Flags:
    """SGLang server flags of one part of an engine, all layers merged (see the module docstring)."""
    flags = parse_flags(["--model-path", cfg.model_path, *engine.launch_args(part)], "placement plan")
    layered: Flags = {}
    if cfg.device_kind == "cpu":
        layered.update({k: list(v) for k, v in SGLANG_CPU_DEFAULTS.items()})
    elif cfg.offload:
        layered["enable-memory-saver"] = []
    if engine.worker_type in ("prefill", "decode"):
        layered["disaggregation-mode"] = [engine.worker_type]
    if cfg.return_routed_experts:
        layered["enable-return-routed-experts"] = []
    passthrough = engine_passthrough(cfg.sglang_args)
    for key, values in passthrough.items():
        layered.pop(key, None)
        layered[key] = values
    where = f"--sglang-config group {engine.group!r}"
    overrides = override_flags(engine.overrides, where)
    _check_not_plan_owned(list(overrides), f"{where}.overrides")
    for key, maybe in overrides.items():
        layered.pop(key, None)
        if maybe is not None:
            layered[key] = maybe
    flags.update(layered)
    return flags


def server_argv(engine: Engine, part: EnginePart, cfg: EngineLaunchConfig) -> list[str]:
    """The full command line of one engine process."""
    if cfg.backend == "sglang":
        flags = sglang_flags(engine, part, cfg)
        python = sglang_python(cfg.sglang_python)
        if cfg.api_key is None:
            return [python, "-m", "sglang.launch_server", *flags_to_argv(flags)]
        # SGLang 0.5.23 (srt/utils/auth.py) checks `Authorization: Bearer`: --api-key guards the
        # plain API (/generate, /get_model_info, ...), --admin-api-key the admin endpoints
        # (weight updates, pause/abort, memory, flush; without it they take the api key), and
        # /health*, /ready*, /metrics stay open. One key for both leaves no endpoint to a
        # weaker key and unlocks the admin-only ones for the key holder alone.
        shim = key_shim("sglang.launch_server", ["--api-key", "--admin-api-key"])
        return [python, *shim, *flags_to_argv(flags)]
    return cpu_engine_argv(engine, part, cfg)


def cpu_engine_argv(engine: Engine, part: EnginePart, cfg: EngineLaunchConfig) -> list[str]:
    """The embedded engine: one process, so no tensor parallelism and no spanning nodes; on a
    GPU plan it computes on its device."""
    if engine.tp_size != 1 or engine.nnodes != 1:
        raise ConfigError(
            "--rollout-num-gpus-per-engine",
            engine.tp_size,
            f"--rollout-engine cpu serves each engine in one process (engine {engine.index} asks for "
            f"{engine.tp_size} devices on {engine.nnodes} node(s)); use 1",
        )
    if engine.worker_type not in ("regular",):
        raise ConfigError(
            "--sglang-config",
            engine.worker_type,
            f"--rollout-engine cpu has no prefill/decode disaggregation (group {engine.group!r})",
        )
    layered = engine_passthrough(cfg.sglang_args)
    where = f"--sglang-config group {engine.group!r}"
    for key, maybe in override_flags(engine.overrides, where).items():
        layered.pop(key, None)
        if maybe is not None:
            layered[key] = maybe
    kept = {k: v for k, v in layered.items() if k in CPU_ENGINE_FLAGS}
    dropped = sorted(k for k in layered if k not in CPU_ENGINE_FLAGS)
    if dropped:
        log.warning("engine %d: --rollout-engine cpu ignores SGLang flags %s", engine.index, dropped)
    base = ["--model-path", cfg.model_path, "--host", engine.host, "--port", str(engine.http_port)]
    if cfg.device_kind == "gpu":
        base += ["--device", "cuda"]  # the plan's GPU (CUDA_VISIBLE_DEVICES), as SGLang would take it
    if cfg.allow_nonfinite_weights:
        base.append("--allow-nonfinite-weights")
    if cfg.return_routed_experts and "enable-return-routed-experts" not in kept:
        base.append("--enable-return-routed-experts")
    return [sys.executable, "-m", "tether.rollout.cpu_engine", *base, *flags_to_argv(kept)]


def server_env(part: EnginePart, cfg: EngineLaunchConfig) -> dict[str, str]:
    """Environment laid over the node agent's: the plan's devices, SGLang's CPU switch, the key."""
    env = dict(part.env)
    if cfg.backend == "sglang" and cfg.device_kind == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if forked_from_zygote(cfg):
        env.update(SECRETLESS_ZYGOTE_ENV)  # the zygote's own: numpy's BLAS on one thread
    if cfg.api_key is not None:
        env[ENGINE_KEY_ENV] = cfg.api_key
    return env


def forked_from_zygote(cfg: EngineLaunchConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """The embedded engine on the CPU is forked from its node's secret-less zygote, unless the
    head's TETHER_FORK_ENGINES=0 asks for each to start as its own interpreter. Not on a GPU
    (CUDA, once initialised, does not survive a fork), nor SGLang (its own interpreter, another
    venv)."""
    return cfg.backend == "cpu" and cfg.device_kind == "cpu" and environ.get(FORK_ENGINES_ENV) != "0"


def engine_name(engine: Engine, part: EnginePart) -> str:
    return f"engine{engine.index}" if engine.nnodes == 1 else f"engine{engine.index}-node{part.node_rank}"


def local_node(part: EnginePart) -> str:
    """Every part on this machine (the supervisor's in-process agent)."""
    return "local"


def build_launch(
    engine: Engine,
    cfg: EngineLaunchConfig,
    node_name: Callable[[EnginePart], str] = local_node,
    node_address: Callable[[EnginePart], str] | None = None,
) -> EngineLaunch:
    """Process specs of one tether-started engine (external engines are not started).

    `node_address`: a part's node address from the plan, to which the node agent binds the
    process's gloo/NCCL sockets (the weight-update group, SGLang's own groups); by default the
    engine's host for its first node and none for the others.
    """

    def address(part: EnginePart) -> str:
        if node_address is not None:
            return node_address(part)
        return engine.host if part.node_rank == 0 else ""

    if engine.external:
        raise ValueError(f"engine {engine.index} at {engine.address} is external; tether does not start it")
    if not engine.parts:
        raise ValueError(f"engine {engine.index} has no processes in the plan")
    fork = forked_from_zygote(cfg)
    specs = [
        ProcessSpec(
            name=engine_name(engine, part),
            argv=server_argv(engine, part, cfg),
            env=server_env(part, cfg),
            node=node_name(part),
            address=address(part),
            run_secret=False,  # an engine speaks HTTP with the engine key, never tether's RPC
            zygote=fork,
            preload=[CPU_ENGINE_PRELOAD] if fork else [],
        )
        for part in sorted(engine.parts, key=lambda p: -p.node_rank)
    ]
    bootstrap: int | None = None
    if engine.worker_type == "prefill" and cfg.backend == "sglang":
        values = sglang_flags(engine, engine.parts[0], cfg).get("disaggregation-bootstrap-port")
        bootstrap = int(values[0]) if values else SGLANG_DEFAULT_BOOTSTRAP_PORT
    return EngineLaunch(
        name=f"engine{engine.index}",
        url=f"http://{engine.address}",
        specs=specs,
        ready_timeout=cfg.ready_timeout,
        worker_type=engine.worker_type,
        bootstrap_port=bootstrap,
        api_key=cfg.api_key,
    )


def http_ready(
    url: str, path: str = "/health_generate", timeout: float = 10.0, api_key: str | None = None
) -> Callable[[], Awaitable[bool]]:
    """A readiness probe: True once GET url+path answers 200 (a refused connection is 'not yet');
    it sends `api_key` (the CPU engine guards /health_generate)."""

    async def probe() -> bool:
        import aiohttp  # by the first probe, after the processes start (see EngineClient)

        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                session.get(url + path, headers=bearer_header(api_key)) as resp,
            ):
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    return probe


async def start_engine(
    sup: Supervisor, launch: EngineLaunch, *, restartable: bool = False
) -> list[ManagedProcess]:
    """Start the engine's processes through the supervisor; return once the head serves /generate.

    Followers start first without a probe (they serve no HTTP and wait for the head to
    rendezvous); the head then has `ready_timeout` seconds to answer /health_generate. If a
    process exits first, this raises ActorDied with its log tail at once (the supervisor stops
    what it started when its block ends). `restartable` engines' later exits are left to their
    owner (the fault-tolerance monitor), which replaces them.
    """
    procs = [await sup.start(spec, restartable=restartable) for spec in launch.specs[:-1]]
    head = await sup.start(
        launch.specs[-1],
        ready=http_ready(launch.url, api_key=launch.api_key),
        ready_timeout=launch.ready_timeout,
        restartable=restartable,
    )
    return [*procs, head]

"""sglang-router as an optional process in front of tether-started engines (--use-sglang-router).

The router (PyPI `sglang-router`, a Rust binary behind `python -m sglang_router.launch_router`)
runs from the SGLang venv. It gets every engine's URL: `--worker-urls` for regular engines, or
`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL` when the server groups split
prefill and decode. tether's routing policy maps onto the router's: round_robin → round_robin,
least_in_flight → power_of_two (load-aware), consistent_hash → manual (sticky on the
X-SMG-Routing-Key header that EngineClient sends). `--sglang-router-<flag> [values]` on
tether's command line becomes the router's `--<flag> [values]` and wins over these defaults.
Readiness: GET /readiness answers 200 once the router has healthy workers. Under --colocate
its worker health checks are off (`RouterLaunchConfig.health_checks`), as slime starts it.

With the run's engine key (`RouterLaunchConfig.api_key`) the router gets `--api-key` through the
same environment-to-argv shim as SGLang (engine_launch.key_shim; never on its command line). It
then requires the key from its own clients (401 without it; /readiness stays open) and uses it
toward the workers, so tether's clients send the same key to the router as to an engine.

    spec = router_spec(launches, RouterLaunchConfig(port=p, policy=cfg.rollout.rollout_routing_policy,
                                                    sglang_args=cfg.sglang_args))
    proc, url = await start_router(supervisor, spec, cfg_router)
    router = Router.from_config(cfg.rollout, [l.url for l in launches], router_url=url)

While it runs, engines leave and enter its worker list through sglang_router_workers.RouterWorkers.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tether.rollout.config import RoutingPolicy
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV
from tether.rollout.engine_api.launch import (
    ROUTER_PREFIX,
    EngineLaunch,
    Flags,
    flags_to_argv,
    http_ready,
    key_shim,
    parse_flags,
    sglang_python,
)
from tether.runtime.errors import ConfigError
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import ManagedProcess, Supervisor

ROUTER_POLICY: dict[str, str] = {
    "round_robin": "round_robin",
    "least_in_flight": "power_of_two",
    "consistent_hash": "manual",
}

# Router flags tether derives from the plan; a pass-through value would route to the wrong place.
ROUTER_OWNED = frozenset({"host", "port", "worker-urls", "pd-disaggregation", "prefill", "decode", "api-key"})


class RouterLaunchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where the router listens and how it routes."""

    port: int
    host: str = "127.0.0.1"
    policy: RoutingPolicy = "least_in_flight"
    sglang_args: list[str] = msgspec.field(default_factory=list)
    """The run's pass-through list; only its `--router-*` entries (from --sglang-router-*) are used."""
    python: str | None = None
    """Python of the venv holding sglang-router; None: the SGLang python (see engine_launch)."""
    ready_timeout: float = 120.0
    name: str = "sglang-router"
    api_key: str | None = None
    """The engine key: the router sends it to the workers (given in its environment)."""
    health_checks: bool = True
    """False: `--disable-health-check` (sglang-router 0.3.2), for engines that release their
    memory between phases (--colocate): its probe generates a token, which a released engine
    cannot, and SGLang's release requires an idle engine."""

    def __repr__(self) -> str:
        return f"RouterLaunchConfig(port={self.port!r}, host={self.host!r}, policy={self.policy!r})"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def router_passthrough(sglang_args: Sequence[str]) -> Flags:
    """`--router-policy x` (from `--sglang-router-policy x`) → `{"policy": ["x"]}`."""
    flags = parse_flags(sglang_args, "--sglang-*")
    out: Flags = {}
    for key, values in flags.items():
        if not key.startswith(ROUTER_PREFIX):
            continue
        name = key[len(ROUTER_PREFIX) :]
        if name in ROUTER_OWNED:
            raise ConfigError(
                "--sglang-router-*", f"--sglang-{key}", "is set by tether from the placement plan"
            )
        out[name] = values
    return out


def router_argv(engines: Sequence[EngineLaunch], cfg: RouterLaunchConfig) -> list[str]:
    """The router's command line for these engines."""
    if not engines:
        raise ConfigError("--use-sglang-router", True, "there are no engines to route to")
    kinds = {launch.worker_type for launch in engines}
    flags: Flags = {"host": [cfg.host], "port": [str(cfg.port)]}
    if kinds <= {"regular"}:
        flags["worker-urls"] = [launch.url for launch in engines]
        worker_args: list[str] = []
    elif kinds <= {"prefill", "decode"} and kinds == {"prefill", "decode"}:
        flags["pd-disaggregation"] = []
        worker_args = []
        for launch in engines:
            if launch.worker_type == "prefill":
                boot = "none" if launch.bootstrap_port is None else str(launch.bootstrap_port)
                worker_args += ["--prefill", launch.url, boot]
            else:
                worker_args += ["--decode", launch.url]
    else:
        raise ConfigError(
            "--sglang-config",
            sorted(kinds),
            "sglang-router needs either only regular engines, or prefill and decode engines together",
        )
    policy = ROUTER_POLICY[cfg.policy]
    if policy == "power_of_two" and len(engines) < 2:
        policy = "round_robin"  # the router refuses power-of-two with one worker; one engine needs no choice
    flags["policy"] = [policy]
    if not cfg.health_checks:
        flags["disable-health-check"] = []
    flags.update(router_passthrough(cfg.sglang_args))
    python = cfg.python or sglang_python()
    launcher = ["-m", "sglang_router.launch_router"]
    if cfg.api_key is not None:
        launcher = key_shim("sglang_router.launch_router", ["--api-key"])
    return [python, *launcher, *flags_to_argv(flags), *worker_args]


def router_spec(engines: Sequence[EngineLaunch], cfg: RouterLaunchConfig, node: str = "local") -> ProcessSpec:
    env = {ENGINE_KEY_ENV: cfg.api_key} if cfg.api_key is not None else {}
    return ProcessSpec(name=cfg.name, argv=router_argv(engines, cfg), env=env, node=node, run_secret=False)


async def start_router(
    sup: Supervisor, spec: ProcessSpec, cfg: RouterLaunchConfig
) -> tuple[ManagedProcess, str]:
    """Start the router (after its engines are ready); return it and its base URL once it routes."""
    ready = http_ready(cfg.url, "/readiness", api_key=cfg.api_key)
    proc = await sup.start(spec, ready=ready, ready_timeout=cfg.ready_timeout)
    return proc, cfg.url

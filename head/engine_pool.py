"""The rollout engines of a run: started from the plan through the supervisor, all at once."""

from __future__ import annotations

import asyncio
import logging

from tether.config import Config
from tether.placement.plan import Plan
from tether.rollout.engine_launch import EngineLaunch, EngineLaunchConfig, build_launch, start_engine
from tether.run_dir import RunDir
from tether.runtime.supervisor import Supervisor

log = logging.getLogger(__name__)


class EnginePool:
    """Engines tether starts (and external ones it only talks to), with the version they serve."""

    def __init__(self, sup: Supervisor, plan: Plan, cfg: Config, run_dir: RunDir) -> None:
        self.sup = sup
        self.plan = plan
        self.cfg = cfg
        self.run_dir = run_dir
        self.launch_cfg = EngineLaunchConfig.from_config(
            cfg.rollout, cfg.fault_tolerance, cfg.sglang_args, plan
        )
        self.launches: dict[str, EngineLaunch] = {}
        self.external: list[str] = []
        self.served_version = 0

    @property
    def urls(self) -> list[str]:
        return [launch.url for launch in self.launches.values()] + self.external

    async def __aenter__(self) -> EnginePool:
        for engine in self.plan.engines:
            if engine.external:
                self.external.append(f"http://{engine.address}")
            elif engine.worker_type != "placeholder":
                launch = build_launch(engine, self.launch_cfg)
                self.launches[launch.name] = launch
        # Start every engine at once: startup time is dominated by each engine's own load.
        async with asyncio.TaskGroup() as tg:
            for launch in self.launches.values():
                tg.create_task(self._start(launch))
        return self

    async def _start(self, launch: EngineLaunch) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await start_engine(self.sup, launch)
        seconds = loop.time() - started
        self.run_dir.event("engine_ready", engine=launch.name, url=launch.url, seconds=seconds)
        log.info("%s ready at %s after %.1fs", launch.name, launch.url, seconds)

    async def __aexit__(self, *exc: object) -> None:
        pass  # the supervisor owns the processes and stops them when its block ends

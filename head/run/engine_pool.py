"""The rollout engines of a run: started from the plan through the supervisor, all at once,
and — with --use-fault-tolerance — watched and replaced when they die or hang.

Recovery of one engine: detect (its process exited, or /health_generate failed or did not
answer within --rollout-health-check-timeout) → take it out of routing (its in-flight samples
come back aborted and their groups are requeued whole) → stop it (SIGTERM, then SIGKILL: a
SIGSTOPped engine only dies by the latter) → start it again on the same devices and ports →
bring it to the version the others serve → route to it again. More than
--max-engine-restarts restarts of one engine end the run with an error naming it.

Recovery when the engine's node is lost (its agent stops answering heartbeats, see
Supervisor): the engine is out of routing as above, an `engine_lost` event names the node, and
the run goes on with the other engines; this engine waits — not counted as a restart, and not
holding up `settled` — until an agent registers for the node again, then is started there,
brought to the served version and routed to (`engine_rejoined`, with that version).
An exit reported as its node's loss takes this path even when the node's agent is back
already (one that gave the head up registers again at once).

With --use-sglang-router, taking an engine out of routing and routing to it again also change
the sglang-router's worker list (`router_workers`, through its HTTP API), each recorded as
`router_worker_removed` / `router_worker_added` with the engine and its URL; the Router holds
the engines apart from the sglang-router for pause and abort (see Router's `front`).

Capacity changes (tether.run.nodes.capacity decides them): `add_engines` starts engines
placed on a node that joined, brings them to the served version and routes to them, as a
rejoined engine; `drain` takes a node's engines out of routing (requests in flight get a
grace to finish, the rest come back aborted and are requeued whole, each sample generated
once), then, with no weight sync in flight (`sync_lock`), stops them and forgets them: the
next sync goes to the engines left. An engine starting is left out of `urls` until its
process is up, so a sync meanwhile does not wait on it.

Under --colocate the engines give their memory to the trainer every step: `memory` (one
EngineMemory) sends each release and resume, and a released engine's /health_generate probe is
held back (it cannot generate, and SGLang releases only an idle engine); its process exit is
still watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from tether.config import Config
from tether.placement.plan import Engine, Plan
from tether.records.run_dir import RunDir
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.engine_api.launch import EngineLaunch, EngineLaunchConfig, build_launch, start_engine
from tether.rollout.engine_api.memory import ALL_TAGS, EngineMemory, MemoryTag
from tether.rollout.routing.router import Router
from tether.rollout.routing.sglang_router_workers import RouterWorkers
from tether.runtime.errors import ConfigError, HeartbeatLost, NodeLost
from tether.runtime.process.supervisor import NODE_LOST, ManagedProcess, Supervisor
from tether.runtime.rpc.liveness import LivenessMonitor

log = logging.getLogger(__name__)

CatchUp = Callable[[EngineClient], Awaitable[None]]
HUNG_ENGINE_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for an engine being replaced


class EngineRestartsExhausted(RuntimeError):
    """An engine failed more often than --max-engine-restarts allows."""


class EnginePool:
    """Engines tether starts (and external ones it only talks to), with the version they serve."""

    def __init__(
        self,
        sup: Supervisor,
        plan: Plan,
        cfg: Config,
        run_dir: RunDir,
        names: dict[int, str],
        *,
        api_key: str,
    ) -> None:
        """`api_key`: the run's engine key, which every engine requires (external ones included)."""
        self.names = names
        self.api_key = api_key
        self.sup = sup
        self.plan = plan
        self.cfg = cfg
        self.run_dir = run_dir
        self.launch_cfg = EngineLaunchConfig.from_config(
            cfg.rollout,
            cfg.fault_tolerance,
            cfg.sglang_args,
            plan,
            api_key=api_key,
            # R3 replays the experts the engines routed each token to: they must record them.
            return_routed_experts=cfg.algorithm.use_rollout_routing_replay,
        )
        self.launches: dict[str, EngineLaunch] = {}
        self.procs: dict[str, list[ManagedProcess]] = {}
        self.external: list[str] = []
        self.served_version = 0
        self.restarts: dict[str, int] = {}
        self.metrics: dict[str, float] = {"ft/engine_restarts": 0.0}
        self.router: Router | None = None
        self.router_workers: RouterWorkers | None = None  # --use-sglang-router: its worker list
        self.catch_up: CatchUp | None = None
        self._failures: asyncio.Queue[BaseException] = asyncio.Queue()
        self._retired: list[EngineClient] = []
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._recovering: set[str] = set()
        self.lost: dict[str, str] = {}  # engine → the node it waits for
        self._recovery_changed = asyncio.Event()
        self._starting: set[str] = set()  # processes starting: left out of weight syncs
        self.sizes: dict[str, int] = {}  # engine URL → its ranks in a weight-update group
        self.sync_lock: asyncio.Lock | None = None  # held by every weight sync (the run's)
        self._monitoring = asyncio.Event()
        self._stack = contextlib.AsyncExitStack()
        self._tg: asyncio.TaskGroup | None = None
        self.memory = EngineMemory()
        self._controls: dict[str, EngineClient] = {}  # memory calls go to each engine, never a router

    @property
    def releases_memory(self) -> bool:
        """Whether the engines give their memory to the trainer between phases (--colocate with
        --offload-rollout, its default)."""
        return self.plan.colocate and self.plan.offload_rollout and bool(self.launches)

    def _control(self, name: str) -> EngineClient:
        if name not in self._controls:
            url = self.launches[name].url
            timeout = self.cfg.weight_sync.update_weight_request_timeout
            self._controls[name] = EngineClient(url, name=name, request_timeout=timeout, api_key=self.api_key)
        return self._controls[name]

    async def release_memory(self, tags: tuple[MemoryTag, ...] = ALL_TAGS) -> None:
        """Every engine releases those of `tags` it holds (see EngineMemory)."""
        await self.memory.release([self._control(name) for name in self.launches], tags)

    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> None:
        """Every engine resumes those of `tags` it released."""
        await self.memory.resume([self._control(name) for name in self.launches], tags)

    def resident(self, tags: tuple[MemoryTag, ...] = ALL_TAGS) -> bool:
        """Whether every engine holds all of `tags`."""
        return all(self.memory.resident(launch.url, tags) for launch in self.launches.values())

    @property
    def urls(self) -> list[str]:
        """The engines weight syncs go to: all but those waiting for their lost node."""
        return [
            launch.url
            for name, launch in self.launches.items()
            if name not in self.lost and name not in self._starting
        ] + self.external

    def sizes_of(self, urls: list[str]) -> list[int]:
        """Each engine's ranks in the weight-update group (its TP size), for `urls` in order."""
        return [self.sizes.get(url, self.cfg.cluster.rollout_num_gpus_per_engine) for url in urls]

    @property
    def fault_tolerant(self) -> bool:
        return self.cfg.fault_tolerance.use_fault_tolerance

    async def __aenter__(self) -> EnginePool:
        addresses = {node.index: node.address for node in self.plan.nodes}
        for engine in self.plan.engines:
            self.sizes[f"http://{engine.address}"] = engine.tp_size
            if engine.external:
                self.external.append(f"http://{engine.address}")
            elif engine.worker_type != "placeholder":
                launch = build_launch(
                    engine,
                    self.launch_cfg,
                    node_name=lambda part: self.names[part.node],
                    node_address=lambda part: addresses[part.node],
                )
                self.launches[launch.name] = launch
        # Start every engine at once: startup time is dominated by each engine's own load.
        async with asyncio.TaskGroup() as tg:
            for launch in self.launches.values():
                tg.create_task(self._start(launch))
        if self.launch_cfg.return_routed_experts:
            for url in self.external:  # tether started the others recording them
                async with EngineClient(url, api_key=self.api_key) as client:
                    check_records_routed_experts(url, await client.get_server_info())
        return self

    async def _start(self, launch: EngineLaunch) -> None:
        started = time.monotonic()
        self.procs[launch.name] = await start_engine(self.sup, launch, restartable=self.fault_tolerant)
        seconds = time.monotonic() - started
        self.run_dir.event("engine_ready", engine=launch.name, url=launch.url, seconds=seconds)
        log.info("%s ready at %s after %.1fs", launch.name, launch.url, seconds)

    async def __aexit__(self, *exc: object) -> None:
        for task in self._monitors.values():  # they run until cancelled
            task.cancel()
        await self._stack.aclose()  # the monitors' task group; the supervisor stops the processes
        for client in [*self._retired, *self._controls.values()]:
            await client.close()
        if self.router_workers is not None:
            await self.router_workers.close()

    async def start_sglang_router(self) -> str:
        """--use-sglang-router: sglang-router in front of the engines; returns its URL."""
        from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_spec, start_router
        from tether.run.nodes.ports import port_free

        # The router is the head's own process: any free port of this machine will do.
        port = next(p for p in range(self.cfg.cluster.node_port_last, 1024, -1) if port_free("127.0.0.1", p))
        router_cfg = RouterLaunchConfig(
            port=port,
            policy=self.cfg.rollout.rollout_routing_policy,
            sglang_args=list(self.cfg.sglang_args),
            api_key=self.api_key,
            # Its /health probe generates a token: on a released engine that fails, and during a
            # release it breaks SGLang's idle assertion (slime disables it alike).
            health_checks=not self.releases_memory,
        )
        _, url = await start_router(
            self.sup, router_spec(list(self.launches.values()), router_cfg), router_cfg
        )
        self.router_workers = RouterWorkers(
            url, api_key=self.api_key, timeout=self.cfg.rollout.engine_request_timeout_seconds
        )
        self.run_dir.event("sglang_router_ready", url=url)
        return url

    def states(self) -> dict[str, tuple[str, int | None, int | None]]:
        """Engine name → (state, version served, requests in flight) now, for `tether status`:
        `lost` while its node is, `restarting` while it is replaced, else `serving`."""
        load = {s.url: s.in_flight for s in self.router.stats()} if self.router is not None else {}
        found: dict[str, tuple[str, int | None, int | None]] = {}
        for name, launch in self.launches.items():
            if name in self.lost:
                found[name] = ("lost", None, None)
            elif name in self._starting and name not in self._recovering:
                found[name] = ("starting", None, None)
            elif name in self._recovering:
                found[name] = ("restarting", None, None)
            else:
                found[name] = ("serving", self.served_version, load.get(launch.url))
        for url in self.external:
            found[url] = ("serving", self.served_version, load.get(url))
        return found

    # ----- fault tolerance -----
    async def start_monitoring(
        self, router: Router, catch_up: CatchUp, sync_lock: asyncio.Lock | None = None
    ) -> None:
        """Watch every engine this pool started (with --use-fault-tolerance). `sync_lock`: held
        by every weight sync; a drain stops engines under it."""
        self.router = router
        self.catch_up = catch_up
        self.sync_lock = sync_lock
        self._monitoring.set()
        if not self.fault_tolerant:
            return
        self._tg = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._monitors = {name: self._tg.create_task(self._watch(name)) for name in self.launches}

    # ----- capacity -----
    async def add_engines(self, engines: list[Engine], node: str, address: str) -> list[str]:
        """Start `engines` (placed on `node`, which joined), bring each to the served version
        and route to it, all at once; returns their names."""
        await self._monitoring.wait()  # routing and catch-up exist only then
        launches = [
            build_launch(
                engine, self.launch_cfg, node_name=lambda part: node, node_address=lambda part: address
            )
            for engine in engines
        ]
        for engine, launch in zip(engines, launches, strict=True):
            if launch.name in self.launches:
                raise ValueError(f"an engine named {launch.name!r} already exists")
            self.launches[launch.name] = launch
            self.sizes[launch.url] = engine.tp_size
        try:
            async with asyncio.TaskGroup() as tg:
                for launch in launches:
                    tg.create_task(self._start_and_route(launch.name))
        except BaseException:
            # A join that fails leaves nothing behind: no process, no route, no place in the syncs.
            for launch in launches:
                await self._unroute(launch.name)
            async with self.sync_lock or contextlib.nullcontext():
                for launch in launches:
                    await self._remove(launch.name)
            raise
        if self.fault_tolerant and self._tg is not None:
            for launch in launches:
                self._monitors[launch.name] = self._tg.create_task(self._watch(launch.name))
        return [launch.name for launch in launches]

    def on_node(self, node: str) -> list[str]:
        """The engines with a process on `node`."""
        return [name for name, launch in self.launches.items() if any(s.node == node for s in launch.specs)]

    async def drain(self, node: str, grace: float) -> dict[str, int]:
        """Take `node`'s engines out of the run (see the module docstring); returns, per
        engine, the requests it was sent while routed (its share of the rollouts)."""
        names = self.on_node(node)
        served: dict[str, int] = {}
        if self.router is not None:
            counts = {stats.url: stats.requests for stats in self.router.stats()}
            served = {name: counts.get(self.launches[name].url, 0) for name in names}
        for name in names:  # from now on its exit is expected, not a failure to recover
            monitor = self._monitors.pop(name, None)
            if monitor is not None:
                monitor.cancel()
        clients = [client for name in names if (client := await self._unroute(name, abandon=False))]
        # Their requests in flight finish (within `grace`); those left come back aborted.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await asyncio.gather(*(client.wait_idle() for client in clients))
        for client in clients:
            client.retire(abandon_in_flight=True)
        async with self.sync_lock or contextlib.nullcontext():
            for name in names:
                await self._remove(name)
        return {name: served.get(name, 0) for name in names}

    async def _remove(self, name: str) -> None:
        """Stop engine `name`'s processes and forget it: later syncs and restarts leave it out."""
        for proc in self.procs.get(name, []):
            if proc.running:
                await self.sup.stop(proc.name)
        launch = self.launches.pop(name)
        self.procs.pop(name, None)
        self.lost.pop(name, None)
        self.sizes.pop(launch.url, None)
        control = self._controls.pop(name, None)
        if control is not None:
            await control.close()

    async def watch(self) -> None:
        """Raise the first failure recovery could not handle (run it beside the loop)."""
        raise await self._failures.get()

    async def _watch(self, name: str) -> None:
        ft = self.cfg.fault_tolerance
        while True:
            client = self._client(name)

            probe = functools.partial(self.probe, name, client)

            # The engine answered /health_generate before it was routed to (start_engine waits for
            # that, within the first-wait grace): heartbeats start now, so a hang seconds after a
            # (re)start is found within interval + timeout.
            monitor = LivenessMonitor(
                probe,
                interval=ft.rollout_health_check_interval,
                timeout=ft.rollout_health_check_timeout,
                first_wait=ft.rollout_health_check_interval,
                name=name,
            )
            loop = asyncio.get_running_loop()
            ready_at = loop.time()
            exited = asyncio.ensure_future(self.procs[name][-1].wait())
            probing = asyncio.ensure_future(monitor.run())
            try:
                done, _ = await asyncio.wait((exited, probing), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (exited, probing):
                    task.cancel()
            detected = loop.time()
            if exited in done and not exited.cancelled():
                info = exited.result()
                if info.reason.startswith(NODE_LOST):
                    # Lost with its node, though an agent may be back already (one that gave the
                    # head up re-registers at once): not an engine fault, not a restart.
                    try:
                        await self._unroute(name)
                        for proc in self.procs[name]:  # its parts on other nodes, if any
                            if proc.running:
                                await self.sup.stop(proc.name, grace=HUNG_ENGINE_GRACE)
                        await self._rejoin(name, NodeLost(info.node, info.reason[len(NODE_LOST) + 2 :]))
                    except BaseException as exc:
                        self._failures.put_nowait(exc)
                        return
                    continue
                reason, detection_s = (
                    f"exited ({info.returncode if info.signal is None else info.signal})",
                    0.0,
                )
            else:
                lost = probing.exception() if probing.done() and not probing.cancelled() else None
                reason = str(lost) if isinstance(lost, HeartbeatLost) else "heartbeat failed"
                last_ok = monitor.last_ok if monitor.last_ok is not None else ready_at
                detection_s = detected - last_ok
            try:
                await self._recover(name, reason, detection_s)
            except NodeLost as lost:  # the run goes on without it until its node is back
                try:
                    await self._rejoin(name, lost)
                except BaseException as exc:
                    self._failures.put_nowait(exc)
                    return
            except BaseException as exc:  # the run cannot go on without this engine
                self._failures.put_nowait(exc)
                return

    async def probe(self, name: str, client: EngineClient) -> None:
        """One heartbeat of engine `name`: a one-token generation, held back while its memory is
        released or being released (see EngineMemory.probe)."""
        timeout = self.cfg.fault_tolerance.rollout_health_check_timeout
        await self.memory.probe(
            self.launches[name].url, lambda: client.health_generate(request_timeout=timeout)
        )

    def _client(self, name: str) -> EngineClient:
        assert self.router is not None
        found = next((c for c in self.router.engines if c.url == self.launches[name].url), None)
        if found is not None:
            return found
        return EngineClient(self.launches[name].url, name=name, api_key=self.api_key)

    async def settled(self, grace: float) -> None:
        """Return once no engine is being replaced, allowing `grace` seconds for a failure that
        has happened to be detected (a sync that just failed on a dying engine, say)."""
        if not self._recovering:
            self._recovery_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._recovery_changed.wait()
        while self._recovering:
            self._recovery_changed.clear()
            await self._recovery_changed.wait()

    async def _recover(self, name: str, reason: str, detection_s: float) -> None:
        self._recovering.add(name)
        self._recovery_changed.set()
        try:
            await self._replace(name, reason, detection_s)
        finally:
            self._recovering.discard(name)
            self._recovery_changed.set()

    async def _rejoin(self, name: str, lost: NodeLost) -> None:
        """Wait for `lost.node` to have an agent again, then start `name` there (again, should
        the node be lost once more while it starts)."""
        while True:
            self.lost[name] = lost.node
            self.run_dir.event("engine_lost", engine=name, node=lost.node, reason=lost.reason)
            log.warning("%s is lost with node %r; the run goes on without it", name, lost.node)
            await self.sup.wait_for_node(lost.node)
            del self.lost[name]
            self._recovering.add(name)
            self._recovery_changed.set()
            started = time.monotonic()
            try:
                await self._start_and_route(name)
            except NodeLost as again:
                lost = again
                continue
            finally:
                self._recovering.discard(name)
                self._recovery_changed.set()
            self.run_dir.event(
                "engine_rejoined",
                engine=name,
                node=lost.node,
                restart_s=time.monotonic() - started,
                version=self.served_version,
            )
            return

    def _node_lost(self, name: str) -> NodeLost | None:
        """A NodeLost for the first node of engine `name` that is lost now, if any."""
        states = self.sup.node_states()
        for spec in self.launches[name].specs:
            state = states.get(spec.node)
            if state is not None and state["state"] == "lost":
                return NodeLost(spec.node, str(state["reason"]))
        return None

    async def _replace(self, name: str, reason: str, detection_s: float) -> None:
        ft = self.cfg.fault_tolerance
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        self.run_dir.event(
            "engine_failed", engine=name, reason=reason, detection_s=detection_s, restart=count
        )
        log.warning("%s failed (%s); restart %d of %d", name, reason, count, ft.max_engine_restarts)
        if count > ft.max_engine_restarts:
            raise EngineRestartsExhausted(
                f"{name} failed {count} times ({reason}); --max-engine-restarts={ft.max_engine_restarts} is used up"
            )
        started = time.monotonic()
        await self._unroute(name)
        for proc in self.procs[name]:
            if proc.running:
                await self.sup.stop(proc.name, grace=HUNG_ENGINE_GRACE)
        try:
            await self._start_and_route(name)
        except NodeLost:
            self.restarts[name] -= 1  # its node's fault, not the engine's
            raise
        restart_s = time.monotonic() - started
        self.metrics.update(
            {
                "ft/engine_restarts": float(sum(self.restarts.values())),
                "ft/last_detection_s": detection_s,
                "ft/last_restart_s": restart_s,
            }
        )
        self.run_dir.event("engine_restarted", engine=name, restart_s=restart_s, version=self.served_version)

    async def _unroute(self, name: str, *, abandon: bool = True) -> EngineClient | None:
        """Stop routing to engine `name` (if it is routed), in the sglang-router's list too;
        returns its client, if it was routed. Without `abandon` its requests in flight go on."""
        assert self.router is not None
        url = self.launches[name].url
        routed = next((c for c in self.router.engines if c.url == url), None)
        if routed is not None:
            self.router.remove_engine(routed.name)
            # Its in-flight requests end now as EngineUnavailable (their groups are requeued
            # whole), not at the request timeout; closing the client under them would turn a
            # clean engine fault into an unrelated error.
            routed.retire(abandon_in_flight=abandon)
            self._retired.append(routed)
        if self.router_workers is not None and await self.router_workers.remove(url):
            self.run_dir.event("router_worker_removed", engine=name, url=url)
        return routed

    async def _start_and_route(self, name: str) -> None:
        """Start engine `name` on its devices, bring it to the served version, route to it.
        Raises NodeLost when its node is (or goes) away meanwhile."""
        assert self.router is not None and self.catch_up is not None
        lost = self._node_lost(name)
        if lost is not None:
            raise lost
        launch = self.launches[name]
        self._starting.add(name)
        try:
            self.procs[name] = await start_engine(self.sup, launch, restartable=True)
        except Exception as exc:
            lost = self._node_lost(name)
            if lost is not None:  # e.g. its readiness failed as the node went
                raise lost from exc
            raise
        finally:
            self._starting.discard(name)
        self.memory.restarted(launch.url)  # the new process holds all of its memory
        if self.releases_memory and not self.resident():
            # The others gave their memory to the trainer: so does this one until the next sync.
            await self.memory.release([self._control(name)])
        client = EngineClient(
            launch.url,
            name=name,
            max_connections=self.cfg.rollout.sglang_server_concurrency,
            request_timeout=self.cfg.rollout.engine_request_timeout_seconds,
            api_key=self.api_key,
        )
        try:
            await self.catch_up(client)  # the current version before the first request
            if self.router_workers is not None:  # requests reach it through the sglang-router
                await self.router_workers.add(
                    launch.url, worker_type=launch.worker_type, bootstrap_port=launch.bootstrap_port
                )
                self.run_dir.event("router_worker_added", engine=name, url=launch.url)
        except Exception as exc:
            await client.close()
            lost = self._node_lost(name)
            if lost is not None:
                raise lost from exc
            raise
        self.router.add_engine(client)


def check_records_routed_experts(url: str, server_info: dict[str, object]) -> None:
    """--use-rollout-routing-replay with an engine tether did not start: refuse one whose server
    arguments (SGLang's /get_server_info) say it does not record routed experts. One that does not
    report the setting passes here; if it then answers without them, the first rollout fails
    naming the flag (`tether.rollout.rollout_fn.take_routed_experts`)."""
    if server_info.get("enable_return_routed_experts") is False:
        raise ConfigError(
            "--use-rollout-routing-replay",
            True,
            f"the external engine {url} was started without --enable-return-routed-experts, so it "
            "cannot return the experts it routed each token to; restart it with that flag",
        )

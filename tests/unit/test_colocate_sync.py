"""Colocated mode on shared devices (--colocate), against fakes that behave as SGLang 0.5.23 does.

- Handle routing: every trainer rank shares its own device's copy; engine TP rank i gets the entry
  of the trainer rank on its device (so a CUDA handle names that engine rank's GPU).
- Memory bookkeeping: a resume names only released tags (SGLang's scheduler raises KeyError on any
  other and dies), a release only resident ones; the tensor transport itself resumes nothing.
- Phase order: engines released right after launch; per step trainer offload → engine weights →
  update → generation memory → generate → release → train (slime's train.py).
- Health probes of a released engine are held back, and a release waits for one in flight.
- An offloaded trainer's weights come back before any export, and leave again after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tether.config import Config, resolve
from tether.placement.colocation import handle_sources
from tether.placement.config import ClusterConfig
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.records.metrics import MetricsSink
from tether.records.progress import RunProgress
from tether.records.run_dir import RunDir
from tether.rollout.engine_api.launch import build_launch
from tether.rollout.engine_api.memory import ALL_TAGS, GENERATION, WEIGHTS, EngineMemory
from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_argv
from tether.rollout.sample import Sample
from tether.run.engine_pool import EnginePool
from tether.run.job import release_engines_at_launch, resume
from tether.run.loops import LoopRange, sync_loop
from tether.run.steps import Steps
from tether.runtime.errors import ConfigError
from tether.runtime.process.sdnotify import Notifier
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import SyncFailed
from tether.sync.ledger import LedgerEntry
from tether.sync.transports.tensor import HandleBucket, TensorTransport, rank_handle_buckets, route_handles
from tether.train.rank.protocol import UpdateWeightsRequest
from tether.train.rank.worker import TrainerWorker
from tether.train.state import offload

Log = list[tuple[Any, ...]]


class SGLangEngine:
    """One engine's memory and weight endpoints as SGLang 0.5.23's scheduler runs them: a resume
    removes each tag from its set of released tags (KeyError for one not released), a release
    asserts that no request is in flight, and a released engine cannot generate."""

    def __init__(self, name: str, log: Log, url: str = "") -> None:
        self.name, self.log = name, log
        self.url = url or f"http://{name}"
        self.offload_tags: set[str] = set()
        self.in_flight = 0
        self.hold: asyncio.Event | None = None  # a probe waits here once it is in flight
        self.probing = asyncio.Event()
        self.version = 0
        self.updates: list[list[str]] = []

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        assert self.in_flight == 0, "release_memory_occupation should be called only when no ongoing request."
        chosen = list(tags or ALL_TAGS)
        self.offload_tags.update(chosen)
        self.log.append((self.name, "release", tuple(chosen)))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        chosen = list(tags or ALL_TAGS)
        for tag in chosen:
            self.offload_tags.remove(tag)
        self.log.append((self.name, "resume", tuple(chosen)))

    async def health_generate(self, request_timeout: float = 30.0) -> None:
        if self.offload_tags:
            raise RuntimeError(f"{self.name}: generating with {sorted(self.offload_tags)} released")
        self.in_flight += 1
        self.probing.set()
        try:
            if self.hold is not None:
                await self.hold.wait()
        finally:
            self.in_flight -= 1
        self.log.append((self.name, "health_generate"))

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        """The HTTP calls a weight transport makes (tether.sync.engine_control.EngineEndpoint)."""
        tags = (body or {}).get("tags")
        if path == "/resume_memory_occupation":
            await self.resume_memory_occupation(tags)
        elif path == "/release_memory_occupation":
            await self.release_memory_occupation(tags)
        elif path == "/update_weights_from_tensor":
            assert "weights" not in self.offload_tags, "a weight update into released weights"
            self.updates.append(body["serialized_named_tensors"])
            if "weight_version" in body:
                self.version = int(body["weight_version"])
        elif path == "/get_model_info":
            return {"weight_version": str(self.version)}
        return {"success": True}


# ----- handle routing -----


def colocated_plan(nodes: int, gpus: list[int], **flags: object) -> Plan:
    """A colocated plan on `nodes` nodes whose visible GPUs are `gpus`, each with its own UUID."""
    inventory = Inventory(
        nodes=[
            Node(
                hostname=f"n{n}",
                address=f"10.0.0.{n + 1}",
                gpus=[Gpu(index=g, uuid=f"GPU-n{n}-{g}") for g in gpus],
            )
            for n in range(nodes)
        ]
    )
    cluster = msgspec.convert({"colocate": True, "actor_num_nodes": nodes, **flags}, ClusterConfig)
    return plan_from_config(cluster, False, False, inventory, resolve=lambda name: None)


def uuid_of(plan: Plan, node: int, device: int) -> str:
    where = plan.nodes[node]
    return where.gpu_uuids[where.devices.index(device)]


class UuidEncoder:
    """A rank's encoder whose entries name the GPU they were shared on, as a CUDA IPC handle does."""

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid

    def share(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(name, t.clone()) for name, t in named]

    def serialize(self, shared: list[tuple[str, torch.Tensor]]) -> str:
        return f"{self.uuid}|{','.join(name for name, _ in shared)}"


def run_ranks(plan: Plan, tensors: list[tuple[str, torch.Tensor]], buffer_size: int) -> list[HandleBucket]:
    """Every actor rank's `rank_handle_buckets` in lock step, its gather to rank 0 done by hand."""
    actor = plan.train_group("actor")
    assert actor is not None
    uuid_of_rank = {
        launch.first_rank + local: uuid_of(plan, launch.node, device)
        for launch in actor.nodes
        for local, device in enumerate(launch.devices)
    }
    sources = handle_sources(plan)
    sent: dict[int, list[str]] = {}

    def gather(rank: int) -> Any:
        def exchange(mine: list[str]) -> list[list[str]] | None:
            if rank:
                sent[rank] = mine
                return None
            return [mine, *(sent.pop(r) for r in range(1, actor.world_size))]

        return exchange

    steps = [
        rank_handle_buckets(
            iter(tensors),
            buffer_size,
            rank=rank,
            sources=sources,
            gather=gather(rank),
            barrier=lambda: None,
            encode=UuidEncoder(uuid_of_rank[rank]),
        )
        for rank in range(actor.world_size)
    ]
    out: list[HandleBucket] = []
    while True:
        for other in steps[1:]:
            assert next(other, "end") in (None, "end")
        item = next(steps[0], None)
        if item is None:
            return out
        assert isinstance(item, HandleBucket)
        out.append(item)


@pytest.mark.parametrize(
    ("nodes", "gpus", "flags", "expected"),
    [
        (1, [0, 1, 2, 3], {"actor_num_gpus_per_node": 4, "rollout_num_gpus_per_engine": 2}, [[0, 1], [2, 3]]),
        (2, [4, 5], {"actor_num_gpus_per_node": 2, "rollout_num_gpus_per_engine": 1}, [[0], [1], [2], [3]]),
        (2, [2, 3], {"actor_num_gpus_per_node": 2, "rollout_num_gpus_per_engine": 2}, [[0, 1], [2, 3]]),
        (
            2,
            [0, 1],
            {
                "actor_num_gpus_per_node": 2,
                "rollout_num_gpus_per_engine": 4,
                "rollout_engines_may_span_nodes": True,
            },
            [[0, 1, 2, 3]],
        ),
    ],
    ids=["1x4-tp2", "2x2-tp1-devices45", "2x2-tp2-devices23", "2x2-tp4-spanning"],
)
def test_each_engine_rank_gets_the_handle_of_its_own_gpu(
    nodes: int, gpus: list[int], flags: dict[str, object], expected: list[list[int]]
) -> None:
    plan = colocated_plan(nodes, gpus, **flags)
    assert handle_sources(plan) == expected
    tensors = [(f"w{i}", torch.full((8,), float(i))) for i in range(5)]
    buckets = run_ranks(plan, tensors, buffer_size=64)  # 2 tensors (32 bytes each) per bucket
    assert [b.last for b in buckets] == [False, False, True] and sum(b.nbytes for b in buckets) == 5 * 32
    for bucket in buckets:
        assert len(bucket.payloads) == len(plan.engines)
        for engine, entries in zip(plan.engines, bucket.payloads, strict=True):
            devices = [
                (p.node, d) for p in sorted(engine.parts, key=lambda p: p.node_rank) for d in p.devices
            ]
            assert len(entries) == engine.tp_size
            # TP rank i opens a handle of the GPU it runs on: UUIDs per GPU, not rank 0's for all.
            assert [e.split("|")[0] for e in entries] == [uuid_of(plan, n, d) for n, d in devices]
    names = [e.split("|")[1] for b in buckets for e in b.payloads[-1][-1:]]
    assert names == ["w0,w1", "w2,w3", "w4"]


def test_an_engine_device_without_an_actor_rank_is_refused() -> None:
    plan = colocated_plan(1, [0, 1, 2, 3], actor_num_gpus_per_node=2, rollout_num_gpus=4)
    with pytest.raises(ConfigError, match="--rollout-num-gpus"):
        handle_sources(plan)


def test_routing_names_an_engine_rank_no_trainer_rank_served() -> None:
    assert route_handles([["a"], ["b", "c"]], [[1, 0], [1]]) == [["b", "a"], ["c"]]
    with pytest.raises(SyncFailed, match="engine 1 TP rank 0: trainer rank 0"):
        route_handles([["a"], ["b"]], [[0], [0]])


def test_colocate_takes_pipeline_parallelism() -> None:
    # Every stage's tensors reach every rank (export.iter_every_stage; tests/integration/test_e2e_run.py
    # runs it): PP > 1 under --colocate is a layout slime's largest MoE recipes use.
    cfg = resolve(["--colocate", "--pipeline-model-parallel-size", "2", "--hf-checkpoint", "/nonexistent/m"])
    assert cfg.cluster.colocate and cfg.megatron.pipeline_model_parallel_size == 2


# ----- memory bookkeeping -----


def test_resume_names_only_released_tags_and_release_only_resident_ones() -> None:
    async def body() -> Log:
        log: Log = []
        engines = [SGLangEngine("e0", log), SGLangEngine("e1", log)]
        memory = EngineMemory()
        await memory.resume(engines, ALL_TAGS)  # nothing released yet: no call (SGLang: KeyError)
        await memory.release(engines)
        await memory.release(engines, GENERATION)  # released already: no call
        assert memory.released("http://e0") == frozenset(ALL_TAGS)
        await memory.resume(engines, WEIGHTS)
        await memory.resume(engines, WEIGHTS)
        assert memory.resident("http://e0", WEIGHTS) and not memory.resident("http://e0")
        await memory.resume(engines, ALL_TAGS)  # only what is still released
        assert all(not e.offload_tags for e in engines)
        return log

    log = asyncio.run(body())
    for name in ("e0", "e1"):
        assert [entry[1:] for entry in log if entry[0] == name] == [
            ("release", ALL_TAGS),
            ("resume", WEIGHTS),
            ("resume", GENERATION),
        ]


def test_tensor_sync_resumes_nothing_itself() -> None:
    """A sync onto engines that released nothing (a resume from --load, --check-weight-update-equal,
    a catch-up): SGLang would die on any resume; the head resumes what it released, not the sync."""

    async def body() -> SGLangEngine:
        engine = SGLangEngine("e0", [])
        transport = TensorTransport(
            [engine], WeightSyncConfig(), encode=UuidEncoder("GPU-0"), engine_ranks=[2]
        )
        entry = await transport.sync(3, iter([("a", torch.ones(4)), ("b", torch.zeros(2))]))
        assert entry.ok and entry.engine_versions == {"e0": 3}
        return engine

    engine = asyncio.run(body())
    assert engine.log == [] and engine.updates == [["GPU-0|a,b", "GPU-0|a,b"]]  # one entry per TP rank


# ----- health probes -----


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[EnginePool, list[SGLangEngine], Log]]:
    """A real EnginePool of a one-box colocated CPU plan, its engines' memory calls and health
    probes going to SGLang-like fakes (nothing is started)."""
    cfg = colocated_config(tmp_path)
    plan = plan_from_config(
        cfg.cluster, False, False, Inventory(nodes=[Node(hostname="box", address="127.0.0.1")])
    )
    engine_pool = EnginePool(None, plan, cfg, RunDir(tmp_path / "run"), {0: "local"}, api_key="k")  # type: ignore[arg-type]
    engine_pool.launches = {
        launch.name: launch for launch in (build_launch(e, engine_pool.launch_cfg) for e in plan.engines)
    }
    log: Log = []
    fakes = [SGLangEngine(name, log, launch.url) for name, launch in engine_pool.launches.items()]
    engine_pool._controls = {f.name: f for f in fakes}  # type: ignore[misc]
    yield engine_pool, fakes, log


def colocated_config(tmp_path: Path, *extra: str) -> Config:
    return resolve(
        [
            "--colocate",
            "--cpu-devices",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "2",
            "--rollout-engine",
            "cpu",
            "--hf-checkpoint",
            str(tmp_path / "no-model"),
            "--run-dir",
            str(tmp_path / "run"),
            *extra,
        ]
    )


def test_probes_pause_while_released_and_a_release_waits_for_one_in_flight(
    pool: tuple[EnginePool, list[SGLangEngine], Log],
) -> None:
    engine_pool, fakes, log = pool
    first = fakes[0]

    async def body() -> None:
        await engine_pool.probe(first.name, first)  # resident: it generates
        first.hold = asyncio.Event()
        in_flight = asyncio.create_task(engine_pool.probe(first.name, first))
        await first.probing.wait()
        release = asyncio.create_task(engine_pool.release_memory())
        for _ in range(20):  # let the release run as far as it can while the probe is in flight
            await asyncio.sleep(0)
        assert not any(entry[1] == "release" for entry in log if entry[0] == first.name)
        first.hold.set()
        await in_flight
        await release  # SGLang's idle assertion holds: the probe ended first
        first.hold = None
        for fake in fakes:  # released: no probe reaches the engine (it could not generate)
            await engine_pool.probe(fake.name, fake)
        await engine_pool.resume_memory(WEIGHTS)
        await engine_pool.probe(first.name, first)  # the KV cache is still released
        await engine_pool.resume_memory(GENERATION)
        await engine_pool.probe(first.name, first)

    asyncio.run(body())
    assert [entry[1:] for entry in log if entry[0] == first.name] == [
        ("health_generate",),
        ("health_generate",),
        ("release", ALL_TAGS),
        ("resume", WEIGHTS),
        ("resume", GENERATION),
        ("health_generate",),
    ]


def test_the_router_starts_without_health_checks_when_engines_release_memory(
    pool: tuple[EnginePool, list[SGLangEngine], Log],
) -> None:
    engine_pool, _, _ = pool
    assert engine_pool.releases_memory
    launches = list(engine_pool.launches.values())
    argv = router_argv(launches, RouterLaunchConfig(port=9, python="/p", health_checks=False))
    assert "--disable-health-check" in argv
    assert "--disable-health-check" not in router_argv(launches, RouterLaunchConfig(port=9, python="/p"))


# ----- phase order -----


class RecordingTrainer:
    def __init__(self, log: Log) -> None:
        self.log = log

    async def offload(self) -> None:
        self.log.append(("trainer", "offload"))

    async def train(self, rollout_id: int, groups: Any, *, weight_version: int) -> dict[str, float]:
        self.log.append(("trainer", "train", rollout_id))
        return {"train/loss": 0.0}

    async def update_weights(
        self, version: int, urls: list[str], *, engines_restarted: bool = False
    ) -> LedgerEntry:
        self.log.append(("trainer", "update_weights", version))
        return LedgerEntry(
            version=version,
            transport="tensor",
            bytes_moved=0,
            pause_seconds=0.0,
            total_seconds=0.0,
            engine_versions={"engine0": version},
            started_at=0.0,
            finished_at=0.0,
            ok=True,
        )

    async def save(
        self, rollout_id: int, weight_version: int, position: Any, *, finalize: bool = False
    ) -> Path:
        self.log.append(("trainer", "save", rollout_id))
        return Path(f"iter_{rollout_id}")

    async def load(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing to load in this run")


class RecordingRollouts:
    speculative_early = None  # no first rollout started before the loop
    router = None
    data = None
    weight_version = 0

    def __init__(self, log: Log) -> None:
        self.log = log
        self.metrics: dict[str, float] = {}

    async def generate(self, rollout_id: int) -> list[list[Sample]]:
        self.log.append(("rollout", "generate", rollout_id))
        return [[Sample(index=rollout_id, group_index=rollout_id, weight_versions=["0"])]]

    def position_after(self, rollout_id: int) -> dict[str, Any]:
        return {}

    async def save_source(self, rollout_id: int) -> None: ...

    def eval_due(self, rollout_id: int) -> bool:
        return False


def test_phases_follow_slimes_order(tmp_path: Path, pool: tuple[EnginePool, list[SGLangEngine], Log]) -> None:
    engine_pool, _, log = pool
    cfg = colocated_config(
        tmp_path, "--num-rollout", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"
    )
    run_dir = RunDir(tmp_path / "run")
    rollouts = RecordingRollouts(log)

    async def body() -> None:
        sink = MetricsSink(run_dir)
        steps = Steps(
            cfg,
            run_dir,
            RecordingTrainer(log),  # type: ignore[arg-type]
            engine_pool,
            rollouts,  # type: ignore[arg-type]
            sink,
            RunProgress(2, 0, "plain"),
            Notifier(None),
        )
        try:
            await release_engines_at_launch(cfg, engine_pool, None)  # type: ignore[arg-type]
            log.append(("head", "trainer starts"))
            start = await resume(cfg, steps)
            await steps.wake_engines()
            await sync_loop(LoopRange(start, 2), rollouts, steps)
        finally:
            sink.close()

    asyncio.run(body())
    engines = ("engine0", "engine1")

    def on_engines(what: str, tags: tuple[str, ...]) -> list[tuple[Any, ...]]:
        return [(name, what, tags) for name in engines]

    def step(rollout_id: int) -> list[tuple[Any, ...]]:
        return [
            ("rollout", "generate", rollout_id),
            *on_engines("release", ALL_TAGS),
            ("trainer", "train", rollout_id),
            ("trainer", "offload"),
            *on_engines("resume", WEIGHTS),
            ("trainer", "update_weights", rollout_id + 1),
            *on_engines("resume", GENERATION),
        ]

    assert log == [
        *on_engines("release", ALL_TAGS),  # right after launch, before the trainer builds its model
        ("head", "trainer starts"),
        # The weights the engines released are the trainer's again (version 0), then generation.
        ("trainer", "offload"),
        *on_engines("resume", WEIGHTS),
        ("trainer", "update_weights", 0),
        *on_engines("resume", GENERATION),
        *step(0),
        *step(1),
        # The interval checkpoint after the last sync: the engines lend their generation memory.
        *on_engines("release", GENERATION),
        ("trainer", "save", 1),
        ("trainer", "offload"),
        *on_engines("resume", GENERATION),
    ]
    assert [e["event"] for e in run_dir_events(run_dir)].count("weights_restored") == 1


def run_dir_events(run_dir: RunDir) -> list[dict[str, Any]]:
    from tether.records.run_dir import read_jsonl

    return read_jsonl(run_dir.events_path)


# ----- an offloaded trainer's export -----


def test_an_offloaded_trainers_weights_come_back_for_the_export_and_leave_after() -> None:
    weight = torch.arange(16, dtype=torch.float32)
    state_tensor = torch.arange(32, dtype=torch.float32) * 3  # optimizer state: stays on host
    expected = (weight.clone(), state_tensor.clone())
    storages = [weight.untyped_storage(), state_tensor.untyped_storage()]
    seen: dict[str, Any] = {}

    async def export(request: UpdateWeightsRequest) -> None:
        # What rank 0's transport reads on the event loop (or another rank on its thread).
        seen["sizes"] = [s.nbytes() for s in storages]
        seen["weight"] = weight.clone()

    async def body() -> None:
        with ThreadPoolExecutor(max_workers=1) as pool:
            worker = TrainerWorker(pool)
            worker._actor = object()
            worker._offload_train = True
            worker._offloaded = offload.offload_storages(storages, weights=[storages[0]])
            assert [s.nbytes() for s in storages] == [0, 0]
            worker._update_weights_colocated = export  # type: ignore[method-assign]
            request = UpdateWeightsRequest(
                version=1, engine_urls=[], weight_sync=WeightSyncConfig(), colocate=True
            )
            await worker.update_weights(request)
            assert [s.nbytes() for s in storages] == [0, 0]  # after the export the weights left again
            await worker._run(lambda: None)  # the next train step brings everything back
            assert worker._offloaded is None

    asyncio.run(body())
    assert seen["sizes"] == [16 * 4, 0] and torch.equal(seen["weight"], expected[0])
    assert torch.equal(weight, expected[0]) and torch.equal(state_tensor, expected[1])

"""Every transport end to end against real CPU engines (subprocesses on 127.0.0.1).

A source sends an HF state dict (a perturbed tiny model, as a trainer's export would yield it);
afterwards the engine's greedy tokens and log-probs must equal a transformers model loaded with
the sent weights, and the engine must report the new version.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
import uvloop
from support.engines import engine_client, launch_engine, prepared_cpu_engine, stop_engine
from support.net import free_port

from tether.rollout.cpu_engine.modeling.tiny_model import write_tiny_model
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.engine_api.memory import GENERATION, WEIGHTS, EngineMemory
from tether.runtime.bucket_stream import STREAM_ENDPOINT
from tether.sync.checkpoint_files import open_checkpoint
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import SyncFailed, served_versions
from tether.sync.ledger import LedgerEntry
from tether.sync.local_store import LocalCheckpointStore
from tether.sync.transports.delta import DeltaDiskTransport
from tether.sync.transports.disk import FullDiskTransport
from tether.sync.transports.distributed import DistributedTransport
from tether.sync.transports.tensor import TensorTransport

PROMPT = [5, 17, 42, 99, 7, 123]


class Engine:
    """A CPU engine (the launcher's command line) that a test stops and starts again on its port."""

    def __init__(self, model: Path, log: Path) -> None:
        self.handle = prepared_cpu_engine(model, log, "--weight-version", "0")
        self.log, self.url = log, self.handle.url

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.handle.proc

    def start(self) -> None:
        launch_engine(self.handle)

    def stop(self) -> None:
        stop_engine(self.handle)
        self.handle.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine(model_dir, tmp_path_factory.mktemp("logs") / "engine.log")
    e.start()
    try:
        yield e
    finally:
        e.stop()


def trained(model_dir: Path, seed: int, frac: float = 0.3) -> dict[str, torch.Tensor]:
    """The base weights after a fake optimizer step (what a trainer's export would yield)."""
    g = torch.Generator().manual_seed(seed)
    with open_checkpoint(model_dir) as view:
        state = {n: view.tensor(n) for n in sorted(view.slots)}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=g) < frac
        state[name] = t + 0.05 * torch.randn(t.shape, generator=g) * mask
    return state


def reference(model_dir: Path, state: dict[str, torch.Tensor], n: int) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    model.eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        tokens = out[0, len(PROMPT) :].tolist()
        logits = model(out).logits[0, len(PROMPT) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return tokens, lp


async def check_engine(url: str, model_dir: Path, state: dict[str, torch.Tensor], version: int) -> None:
    async with engine_client(url) as c:
        assert await c.get_weight_version() == str(version)
        params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        got = await c.generate(PROMPT, params, return_logprob=True)
    tokens, lp = await asyncio.to_thread(reference, model_dir, state, 8)
    assert got.output_ids == tokens
    assert got.log_probs() == pytest.approx(lp, abs=2e-4)


def cfg(tmp_path: Path, **kw: object) -> WeightSyncConfig:
    base: dict[str, object] = {"update_weight_buffer_size": 40_000, "update_weight_request_timeout": 60.0}
    base.update(kw)
    return WeightSyncConfig(**base)  # type: ignore[arg-type]


def run(coro: object) -> object:
    return uvloop.run(coro)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flattened", "wire", "streamed"),
    [
        (False, torch.float32, True),
        (True, torch.float32, True),
        (True, torch.bfloat16, False),
        (False, torch.bfloat16, False),
    ],
    ids=["per-tensor-streamed", "flattened-streamed", "flattened-bf16", "per-tensor-bf16"],
)
def test_distributed_transport_buckets_and_matches_transformers(
    engine: Engine, model_dir: Path, tmp_path: Path, flattened: bool, wire: torch.dtype, streamed: bool
) -> None:
    """Per-tensor broadcasts land in the live parameters; flattened buckets become their storage;
    bf16 on the wire is converted into the engine's float32 parameters. Streamed: the buckets go
    as one stream (the CPU engine offers it); else one SGLang request per bucket."""

    async def body() -> None:
        async with engine_client(engine.url, name="e0") as client:
            t = DistributedTransport(
                [client],
                cfg(
                    tmp_path, update_weight_collective_timeout=60.0, update_weight_flattened_bucket=flattened
                ),
                master_port=free_port(),
                stream_buckets=streamed,
            )
            try:
                base = (await served_versions([client], 10))["e0"]  # the engine served earlier cases
                assert base is not None
                await t.connect()
                assert t.streamed == streamed
                state = {n: x.to(wire) for n, x in trained(model_dir, seed=1).items()}
                entry = await t.sync(base + 1, iter(state.items()))
                assert entry.ok and entry.engine_versions == {"e0": base + 1}
                assert entry.bytes_moved == sum(x.numel() * x.element_size() for x in state.values())
                await check_engine(engine.url, model_dir, {n: x.float() for n, x in state.items()}, base + 1)
                # The same buckets again land in place (flattened: in the buffers now backing them).
                state = {n: x.to(wire) for n, x in trained(model_dir, seed=6).items()}
                assert (await t.sync(base + 2, iter(state.items()))).ok
                await check_engine(engine.url, model_dir, {n: x.float() for n, x in state.items()}, base + 2)
                # A failed bucket (a dtype the engine refuses) releases every lock and leaves version 1.
                bad = trained(model_dir, seed=2)
                bad["model.norm.weight"] = bad["model.norm.weight"].to(torch.int32)
                with pytest.raises(Exception):  # noqa: B017 - the engine's error type is its own
                    await t.sync(base + 3, iter(bad.items()))
                assert await served_versions([client], 10) == {"e0": base + 2}
                # The engine was continued and its session closed: a new sync (new group) works.
                state2 = trained(model_dir, seed=3)
                assert (await t.sync(base + 3, iter(state2.items()))).ok
                await check_engine(engine.url, model_dir, state2, base + 3)
            finally:
                await t.close()

    run(body())


class AnswersAfterNextBucket:
    """An engine whose answer to each bucket is held until the next bucket's request has gone
    out (the last bucket's, which flushes the cache, is not held): a sender that waited for
    each answer before sending on would stall here."""

    def __init__(self, client: EngineClient) -> None:
        self.client, self.name, self.url = client, client.name, client.url
        self.sent = 0
        self.changed = asyncio.Condition()

    async def request(
        self, method: str, path: str, body: dict[str, object] | None = None, **kw: object
    ) -> object:
        if path != "/update_weights_from_distributed":
            return await self.client.request(method, path, body, **kw)  # type: ignore[arg-type]
        async with self.changed:
            self.sent += 1
            mine = self.sent
            self.changed.notify_all()
        answer = await self.client.request(method, path, body, **kw)  # type: ignore[arg-type]
        assert body is not None
        if not body["flush_cache"]:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.sent > mine), 20)
        return answer


def test_distributed_buckets_are_pipelined(engine: Engine, model_dir: Path, tmp_path: Path) -> None:
    """Bucket k+1's request goes out once bucket k's bytes have left, before bucket k's answer."""

    async def body() -> None:
        async with engine_client(engine.url, name="p0") as client:
            held = AnswersAfterNextBucket(client)
            t = DistributedTransport(
                [held],
                cfg(tmp_path, update_weight_collective_timeout=60.0),
                master_port=free_port(),
                stream_buckets=False,  # SGLang's request per bucket, as against a real SGLang
            )
            try:
                base = (await served_versions([client], 10))["p0"]
                assert base is not None
                state = trained(model_dir, seed=9)
                entry = await t.sync(base + 1, iter(state.items()))
                assert entry.ok and entry.engine_versions == {"p0": base + 1}
                assert held.sent > 3  # several buckets, each answered only after the next was sent
                await check_engine(engine.url, model_dir, state, base + 1)
            finally:
                await t.close()

    run(body())


def test_distributed_group_rebuilt_after_engine_restart(model_dir: Path, tmp_path: Path) -> None:
    eng = Engine(model_dir, tmp_path / "restart.log")
    eng.start()
    try:

        async def body() -> None:
            async with engine_client(eng.url, name="r0") as client:
                t = DistributedTransport(
                    [client], cfg(tmp_path, update_weight_collective_timeout=60.0), master_port=free_port()
                )
                try:
                    assert (await t.sync(1, iter(trained(model_dir, seed=4).items()))).ok
                    await asyncio.to_thread(eng.restart)
                    assert await served_versions([client], 10) == {"r0": 0}
                    t.mark_engine_restarted("r0")
                    state = trained(model_dir, seed=5)
                    assert (await t.sync(1, iter(state.items()))).ok
                    await check_engine(eng.url, model_dir, state, 1)
                finally:
                    await t.close()

        run(body())
    finally:
        eng.stop()


class RefusesBeforeReceiving:
    """A real engine behind a front that answers one update request itself with a refusal, so
    the engine never joins that broadcast (as an engine that refuses before it receives)."""

    def __init__(self, client: EngineClient, path: str, refuse_at: int) -> None:
        self.client, self.name, self.url = client, client.name, client.url
        self.path, self.refuse_at, self.seen = path, refuse_at, 0
        self.calls: list[tuple[str, object]] = []

    async def request(
        self, method: str, path: str, body: dict[str, object] | None = None, **kw: object
    ) -> object:
        self.calls.append((path, body))
        if path == self.path:
            self.seen += 1
            if self.seen - 1 == self.refuse_at:
                return {"success": False, "message": "refused by the front"}
        return await self.client.request(method, path, body, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("streamed", [False, True], ids=["per-bucket", "streamed"])
def test_a_refused_broadcast_fails_the_sync_at_once_and_the_next_builds_a_new_group(
    engine: Engine, model_dir: Path, tmp_path: Path, streamed: bool
) -> None:
    """The sender is inside a broadcast the engine never joins: the sync raises SyncFailed
    naming the engine and its answer well within the group's timeout, the engine keeps its
    version, and the next sync drops the old group on the engine (which ends the broadcast
    left behind) and goes through on a new one."""

    async def body() -> None:
        async with engine_client(engine.url, name="f0") as client:
            path = STREAM_ENDPOINT if streamed else "/update_weights_from_distributed"
            front = RefusesBeforeReceiving(client, path, refuse_at=0 if streamed else 1)
            limit = 60.0
            t = DistributedTransport(
                [front],
                cfg(tmp_path, update_weight_collective_timeout=limit),
                master_port=free_port(),
                stream_buckets=streamed,
            )
            try:
                base = (await served_versions([client], 10))["f0"]
                assert base is not None
                loop = asyncio.get_running_loop()
                started = loop.time()
                with pytest.raises(SyncFailed, match=r"engine f0 .*refused by the front"):
                    await t.sync(base + 1, iter(trained(model_dir, seed=21).items()))
                assert loop.time() - started < limit / 2
                assert t.streamed == streamed and t.group is not None
                first = t.group.group_name
                assert await served_versions([client], 10) == {"f0": base}
                front.refuse_at = -1
                state = trained(model_dir, seed=22)
                assert (await t.sync(base + 1, iter(state.items()))).ok
                assert t.group is not None and t.group.group_name != first
                assert ("/destroy_weights_update_group", {"group_name": first}) in front.calls
                await check_engine(engine.url, model_dir, state, base + 1)
            finally:
                await t.close()

    run(body())


def test_full_disk_transport_publishes_and_reloads(engine: Engine, model_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with engine_client(engine.url, name="e0") as client:
            hooked: list[str] = []
            c = cfg(tmp_path, update_weight_transport="disk", update_weight_disk_dir=str(tmp_path / "pub"))
            t = FullDiskTransport([client], c, base_dir=model_dir, post_write_hook=hooked.append)
            for v in (11, 12):
                state = trained(model_dir, seed=v)
                entry = await t.sync(v, iter(state.items()))
                assert entry.ok and entry.engine_versions == {"e0": v}
                await check_engine(engine.url, model_dir, state, v)
            assert [Path(h).name for h in hooked] == ["weight_v000011", "weight_v000012"]
            # old versions are removed unless --update-weight-disk-keep-files
            assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["weight_v000012"]
            pub = tmp_path / "pub" / "weight_v000012"
            assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {
                p.name for p in pub.iterdir()
            }

    run(body())


def test_delta_transport_chain_restart_and_repair(model_dir: Path, tmp_path: Path) -> None:
    eng = Engine(model_dir, tmp_path / "delta.log")
    eng.start()
    try:

        async def body() -> None:
            async with engine_client(eng.url, name="d0") as client:
                c = cfg(
                    tmp_path,
                    update_weight_mode="delta",
                    update_weight_transport="disk",
                    update_weight_disk_dir=str(tmp_path / "pub"),
                    update_weight_local_checkpoint_dir=str(tmp_path / "local"),
                )
                t = DeltaDiskTransport([client], c, hf_checkpoint=model_dir)
                state = {}
                for v in (1, 2, 3):
                    state = trained(model_dir, seed=20 + v, frac=0.02)
                    entry = await t.sync(v, iter(state.items()))
                    assert entry.ok and entry.engine_versions == {"d0": v}
                    assert t.last_index is not None and entry.bytes_moved < t.last_index.full_bytes
                await check_engine(eng.url, model_dir, state, 3)
                # An engine restarted mid-chain comes back on --hf-checkpoint (version 0) and catches up.
                await asyncio.to_thread(eng.restart)
                assert await served_versions([client], 10) == {"d0": 0}
                await t.catch_up(client)
                await check_engine(eng.url, model_dir, state, 3)
                # A host whose local checkpoint lost its chain is repaired from a full version.
                store = LocalCheckpointStore(tmp_path / "local")
                cur = store.current_path()
                assert cur is not None
                bad_store_marker = cur / "tether_weights.json"
                bad_store_marker.write_text(
                    bad_store_marker.read_text().replace('"version":3', '"version":1')
                )
                state = trained(model_dir, seed=30, frac=0.02)
                entry = await t.sync(4, iter(state.items()))
                assert entry.ok and store.version() == 4
                await check_engine(eng.url, model_dir, state, 4)
                store.verify()

        run(body())
    finally:
        eng.stop()


def test_tensor_transport_colocated(engine: Engine, model_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        async with engine_client(engine.url, name="e0") as client:
            t = TensorTransport([client], cfg(tmp_path))
            memory = EngineMemory()
            await memory.release([client])  # as before training: every tag
            await memory.resume([client], WEIGHTS)  # the head's order around a colocated sync
            state = trained(model_dir, seed=40)
            entry = await t.sync(41, iter(state.items()))
            await memory.resume([client], GENERATION)
            assert memory.released(client.url) == frozenset()
            assert entry.ok and entry.engine_versions == {"e0": 41}
            await check_engine(engine.url, model_dir, state, 41)

    run(body())


_FLAT_RECEIVER = """
import sys, torch
from datetime import timedelta
from tether.runtime.weight_group import init_weight_group, broadcast, destroy_weight_group
g = init_weight_group(sys.argv[1], 1, 2, sys.argv[2], "gloo", timedelta(seconds=60))
buf = torch.empty(int(sys.argv[3]), dtype=torch.uint8)  # what SGLang's flattened_bucket receives
broadcast(buf, 0, g)
torch.save(buf, sys.argv[4])
destroy_weight_group(g)  # leaving with gloo's threads alive aborts the process at exit
"""


def test_flattened_bucket_is_one_broadcast_of_the_tensors_bytes(tmp_path: Path) -> None:
    from datetime import timedelta

    from tether.runtime.weight_group import destroy_weight_group, init_weight_group
    from tether.sync.buckets.fill import BucketFiller

    bucket = [
        ("b.bias", torch.arange(7, dtype=torch.float32)),
        ("a.weight", torch.randn(5, 3).to(torch.bfloat16).t()),  # not contiguous: copied by strides
        ("c.mask", torch.tensor([True, False, True])),
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
    method, name, out = f"tcp://127.0.0.1:{free_port()}", "flat-test", tmp_path / "got.pt"
    proc = subprocess.Popen([sys.executable, "-c", _FLAT_RECEIVER, method, name, str(nbytes), str(out)])
    try:
        cfg = WeightSyncConfig(update_weight_flattened_bucket=True)
        transport = DistributedTransport([], cfg, master_port=0)
        transport.group = init_weight_group(method, 0, 2, name, "gloo", timedelta(seconds=60))
        filled = BucketFiller(bucket, 1024, torch.device("cpu"), flattened=True, buffers=[None, None]).next()
        assert filled is not None and filled.last and filled.flat is not None
        assert [n for n, _ in filled.tensors] == [n for n, _ in bucket]
        transport._broadcast_bucket(filled.tensors, filled.flat)
        assert proc.wait(timeout=60) == 0
        destroy_weight_group(transport.group)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = torch.load(out)
    offset = 0
    for _, t in bucket:
        n = t.numel() * t.element_size()
        assert torch.equal(got[offset : offset + n].clone().view(t.dtype).reshape(t.shape), t)
        offset += n
    assert offset == got.numel()


def test_engine_stops_promptly_while_a_weight_receive_waits_for_a_gone_sender(
    model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM during a receive whose sender never sends: the engine exits instead of waiting
    out the group's ten-minute timeout."""
    from datetime import timedelta

    from tether.runtime.weight_group import destroy_weight_group, init_weight_group

    eng = Engine(model_dir, tmp_path / "stop.log")
    eng.start()
    try:

        async def body() -> None:
            port = free_port()
            async with engine_client(eng.url, name="s0") as client:
                join = {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "stop-test",
                    "backend": "gloo",
                }
                own = asyncio.create_task(
                    asyncio.to_thread(
                        init_weight_group,
                        f"tcp://127.0.0.1:{port}",
                        0,
                        2,
                        "stop-test",
                        "gloo",
                        timedelta(seconds=60),
                    )
                )
                await client.request("POST", "/init_weights_update_group", join, retry="never")
                group = await own
                await client.request("POST", "/begin_weight_update", {}, retry="never")
                update = {
                    "names": ["model.norm.weight"],
                    "dtypes": ["float32"],
                    "shapes": [[64]],
                    "group_name": "stop-test",
                }
                pending = asyncio.create_task(
                    client.request("POST", "/update_weights_from_distributed", update, retry="never")
                )
                async with asyncio.timeout(60):
                    while True:  # the receive has begun once the engine reports it
                        info = await client.request("GET", "/get_server_info", None, retry="never")
                        if info["internal_states"][0]["weight_receives"] == 1:
                            break
                        await asyncio.sleep(0.05)
                assert eng.proc is not None
                eng.proc.terminate()
                assert await asyncio.to_thread(eng.proc.wait, 60) == 0
                assert "exiting at once" in eng.log.read_text()
                with pytest.raises(Exception):  # noqa: B017 - the connection dropped with the engine
                    await pending
                await asyncio.to_thread(destroy_weight_group, group)

        run(body())
    finally:
        eng.stop()


class _Agreement:
    """The all-reduce of `sync_stage`'s agreements between sources in one process."""

    def __init__(self, parties: int) -> None:
        self.barrier = asyncio.Barrier(parties)
        self.rounds: dict[int, list[bool]] = {}

    def party(self) -> Callable[[bool], Awaitable[bool]]:
        done = 0

        async def agree(ok: bool) -> bool:
            nonlocal done
            votes = self.rounds.setdefault(done, [])
            votes.append(ok)
            done += 1
            await self.barrier.wait()
            return all(votes)

        return agree


def test_pipeline_stages_each_send_over_their_own_group(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    """Two stage sources (one controlling the engine) each broadcast half of the model over
    their own group; a failure in either fails both and leaves the engine on the old version,
    continued, with its update session closed."""

    async def body() -> None:
        async with engine_client(engine.url, name="e0") as client:
            conf = cfg(tmp_path, update_weight_collective_timeout=60.0)
            stages = [
                DistributedTransport([client], conf, master_port=free_port(), group_tag="pp0-"),
                DistributedTransport([client], conf, master_port=0, control_engines=False, group_tag="pp1-"),
            ]
            try:
                base = (await served_versions([client], 10))["e0"]
                assert base is not None

                async def sync(state: dict[str, torch.Tensor], version: int) -> list[object]:
                    names = sorted(state)
                    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
                    agreement = _Agreement(2)
                    return await asyncio.gather(
                        *(
                            t.sync_stage(
                                version, iter([(n, state[n]) for n in half]), agreement.party(), (i, 2)
                            )
                            for i, (t, half) in enumerate(zip(stages, halves, strict=True))
                        ),
                        return_exceptions=True,
                    )

                state = trained(model_dir, seed=11)
                first, second = await sync(state, base + 1)
                assert (
                    isinstance(first, LedgerEntry) and first.ok and first.engine_versions == {"e0": base + 1}
                )
                assert second is None
                await check_engine(engine.url, model_dir, state, base + 1)
                # The second stage's bucket is refused: both stages fail, nothing moves on.
                bad = trained(model_dir, seed=12)
                bad[sorted(bad)[-1]] = bad[sorted(bad)[-1]].to(torch.int32)
                results = await sync(bad, base + 2)
                assert all(isinstance(r, SyncFailed) for r in results), results
                assert await served_versions([client], 10) == {"e0": base + 1}
                # Continued and closed: the next sync (groups rebuilt) goes through.
                state = trained(model_dir, seed=13)
                first, _ = await sync(state, base + 2)
                assert isinstance(first, LedgerEntry) and first.engine_versions == {"e0": base + 2}
                await check_engine(engine.url, model_dir, state, base + 2)
            finally:
                for t in stages:
                    await t.close()

    run(body())

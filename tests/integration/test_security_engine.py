"""Nobody who can reach an engine's port can steer, stall or break a run.

The attacks of issue 16 against the engine side, each against real CPU engine processes on
127.0.0.1 (and, for authentication, the launch paths of real SGLang and the sglang-router):
unauthenticated calls, NaN weights, a scheduler that dies or hangs, weight-group joins to an
address that never answers, oversized and slow-to-tokenize inputs, corrupt checkpoints, and
secrets leaking into command lines or into processes that do not need them. The conformance
suite (test_engine_conformance.py) checks the 401s against real SGLang too; the checks that
need no process (key files, the Bearer check, the launch specs) are in
tests/unit/test_security_engine_keys.py.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.engines import (
    ENGINE_KEY,
    Engine,
    EngineFactory,
    cpu_engine_launch,
    engine_client,
    local_plan_engine,
    make_models,
    start_cpu_engine,
    stop_engine,
    wait_until,
    write_key,
)
from support.net import free_port

from tether.rollout.cpu_engine.http.common import EngineState
from tether.rollout.cpu_engine.http.sglang_api import EngineApp
from tether.rollout.cpu_engine.scheduler import Scheduler
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV
from tether.rollout.engine_api.client import EngineClient, EngineError
from tether.rollout.engine_api.launch import EngineLaunchConfig, build_launch
from tether.rollout.engine_api.weights import encode_named_tensors
from tether.runtime.loop import run
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret
from tether.runtime.weight_group import WeightGroup, broadcast, destroy_weight_group, init_weight_group
from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import SyncFailed
from tether.sync.transports.distributed import DistributedTransport

NAN_TENSOR = "model.layers.0.mlp.up_proj.weight"
PROBE = "model.layers.0.self_attn.q_proj.weight"  # differs between v1 and v2: shows which serve
HEALTH_TIMEOUT_S = 3.0
SETUP_TIMEOUT_S = 5.0
MAX_PROMPTS = 4
MAX_BODY = 12 << 20  # room for the 10 MB text below, not for 13 MB


def test_key_shim_runs_the_module_with_the_key_and_redacts_it_from_logs(tmp_path: Path) -> None:
    """The shim SGLang and the sglang-router start through, with a stand-in for the router's
    module (whose name tether's rollout/routing/sglang_router.py, beside the shim, must not shadow)."""
    (tmp_path / "sglang_router.py").write_text(
        "import argparse, logging, os, sys\n"
        "logging.basicConfig(level=logging.INFO, force=True)\n"
        "logging.getLogger('router').info('server_args=%s', sys.argv[1:])\n"
        "parser = argparse.ArgumentParser()\n"
        "for flag in ('--api-key', '--admin-api-key', '--port'):\n"
        "    parser.add_argument(flag)\n"
        "args = parser.parse_args()\n"
        "print('parsed', [args.api_key, args.admin_api_key], 'env', os.environ.get('TETHER_ENGINE_API_KEY'), "
        "flush=True)\n"
    )
    # A key may start with "-" (secrets.token_urlsafe): argparse must still take it as the value.
    key = "-shim-key-" + "z" * 20
    env = {**os.environ, ENGINE_KEY_ENV: key, "PYTHONPATH": str(tmp_path)}
    shim = __import__("tether.rollout.engine_api.key_shim", fromlist=["x"]).__file__
    proc = subprocess.run(
        [sys.executable, shim, "sglang_router", "--api-key,--admin-api-key", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"parsed ['{key}', '{key}'] env None" in proc.stdout
    assert key not in proc.stderr and "<redacted>" in proc.stderr and "'--port', '1'" in proc.stderr


def engine_routes() -> list[tuple[str, str]]:
    """Every (method, path) the CPU engine serves, read from its app (a new endpoint is covered)."""
    state = EngineState(scheduler=cast(Scheduler, None), model_path="", host="", port=0)
    app = EngineApp(state).build()
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    out = set()
    for method, path in routes:
        if method == "HEAD":
            continue
        out |= {("GET", path), ("POST", path)} if method == "*" else {(method, path)}
    return sorted(out)


# ----- one engine for most attacks (each test leaves it serving v1) -----


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = start_cpu_engine(
        models[0],
        tmp_path_factory.mktemp("engine"),
        "--health-check-timeout",
        str(HEALTH_TIMEOUT_S),
        "--weight-group-setup-timeout",
        str(SETUP_TIMEOUT_S),
        "--max-prompts-per-request",
        str(MAX_PROMPTS),
        "--max-request-bytes",
        str(MAX_BODY),
        "--weight-version",
        "v1",
    )
    try:
        yield eng
    finally:
        stop_engine(eng)


def probe(engine: Engine) -> torch.Tensor:
    """The first rows of PROBE as the engine serves it."""
    return torch.tensor(engine.post("/get_weights_by_name", {"name": PROBE, "truncate_size": 8}))


def serves(engine: Engine, tensors: dict[str, torch.Tensor]) -> bool:
    return torch.allclose(probe(engine), tensors[PROBE][:8])


def greedy(engine: Engine, n: int = 6) -> dict[str, Any]:
    body = {
        "input_ids": [1, 5, 6, 7],
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return dict(engine.post("/generate", body))


def serves_v1(engine: Engine, models: tuple[str, str]) -> None:
    v1 = load_file(str(Path(models[0]) / "model.safetensors"))
    assert serves(engine, v1)
    assert engine.get("/get_model_info")["weight_version"] == "v1"


def restore_v1(engine: Engine, models: tuple[str, str]) -> None:
    engine.post("/update_weights_from_disk", {"model_path": models[0], "weight_version": "v1"})


def with_nan(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in tensors.items()}
    out[NAN_TENSOR].view(-1)[3] = float("nan")
    return out


def join_group(engine: Engine, name: str) -> WeightGroup:
    """This process as rank 0 of a gloo group the engine joins as rank 1."""
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.post, "/init_weights_update_group", body)
        group = init_weight_group(f"tcp://127.0.0.1:{port}", 0, 2, name, "gloo")
        assert joined.result(timeout=60)["success"] is True
    return group


def test_every_endpoint_but_health_refuses_strangers(engine: Engine, models: tuple[str, str]) -> None:
    routes = engine_routes()
    assert ("POST", "/update_weights_from_disk") in routes and (
        "POST",
        "/init_weights_update_group",
    ) in routes
    before = probe(engine)
    for key in (None, "not-the-key-" + "x" * 16):
        stranger = replace(engine, api_key=key)
        for method, path in routes:
            status, body = stranger.request(path, {"model_path": models[1]}, method=method)
            if (method, path) == ("GET", "/health"):
                assert status == 200
            else:
                assert status == 401, f"{method} {path}: {status} {body}"
                assert "Authorization: Bearer" in body["error"]["message"]
    assert torch.equal(probe(engine), before)
    serves_v1(engine, models)

    async def clients() -> None:
        async with EngineClient(engine.url, name="stranger") as stranger:
            with pytest.raises(EngineError) as err:
                await stranger.get_model_info()
            assert err.value.status == 401
        async with engine_client(engine.url) as client:
            assert (await client.get_model_info())["weight_version"] == "v1"
            await client.health_generate()

    run(clients())


def test_nonfinite_weights_are_refused_on_every_update_path(
    engine: Engine, models: tuple[str, str], tmp_path: Path
) -> None:
    v1 = load_file(str(Path(models[0]) / "model.safetensors"))
    v2 = load_file(str(Path(models[1]) / "model.safetensors"))
    bad = with_nan(v2)  # every tensor new, one poisoned: a refusal must leave all of v1
    baseline = greedy(engine)["output_ids"]
    try:
        # From disk.
        poisoned = tmp_path / "poisoned"
        shutil.copytree(models[1], poisoned)
        save_file(bad, str(poisoned / "model.safetensors"))
        status, body = engine.request(
            "/update_weights_from_disk", {"model_path": str(poisoned), "weight_version": "nan"}
        )
        assert status == 400 and NAN_TENSOR in body["message"] and "NaN" in body["message"]
        serves_v1(engine, models)
        # From tensor handles.
        alive: list[torch.Tensor] = []
        engine.post("/begin_weight_update", {})
        try:
            payload = {"serialized_named_tensors": [encode_named_tensors(list(bad.items()), alive)]}
            status, body = engine.request("/update_weights_from_tensor", {**payload, "weight_version": "nan"})
        finally:
            engine.post("/end_weight_update", {})
        assert status == 400 and NAN_TENSOR in body["message"]
        serves_v1(engine, models)
        # From a broadcast, tensor by tensor and as one flattened bucket, one bucket each.
        total = sum(t.numel() * t.element_size() for t in bad.values())
        for flattened in (False, True):
            cfg = WeightSyncConfig(
                update_weight_buffer_size=total + 1,
                update_weight_flattened_bucket=flattened,
                update_weight_request_timeout=60.0,
                update_weight_collective_timeout=60.0,
            )

            async def sync(tensors: dict[str, torch.Tensor], cfg: WeightSyncConfig = cfg) -> None:
                async with engine_client(engine.url, name="e0") as client:
                    sender = DistributedTransport([client], cfg, master_port=free_port())
                    try:
                        await sender.sync(9, iter(sorted(tensors.items())))
                    finally:
                        await sender.close()

            with pytest.raises((EngineError, SyncFailed, ExceptionGroup)) as err:
                run(sync(bad))
            if isinstance(err.value, ExceptionGroup):  # the bucket's post failed in a task group
                assert err.group_contains(EngineError, match=NAN_TENSOR, depth=None)
            else:
                assert NAN_TENSOR in str(err.value)
            serves_v1(engine, models)
            # Clean syncs after the refusal land whole, there and back (the checked receive
            # swaps buffers rather than copying: both directions must serve the right ones).
            run(sync(v2))
            assert serves(engine, v2) and not serves(engine, v1)
            run(sync(v1))
            assert serves(engine, v1)
            assert greedy(engine)["output_ids"] == baseline
            engine.post("/update_weight_version", {"new_version": "v1"})
        assert greedy(engine)["output_ids"] == baseline  # still generating, with the old weights
    finally:
        restore_v1(engine, models)


def test_health_generate_fails_while_the_scheduler_is_stuck(engine: Engine, models: tuple[str, str]) -> None:
    """A decoding request no longer makes /health_generate answer 200: the scheduler must step.
    It is held here in a weight receive whose sender never sends (between two model steps)."""
    norm = load_file(str(Path(models[0]) / "model.safetensors"))[PROBE]  # v1's own values
    long_body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True},
    }
    group = join_group(engine, f"stuck-{free_port()}")
    try:
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(engine.post, "/generate", long_body, 300)
            wait_until(lambda: info(engine)["running"] >= 1, what="a request decoding")
            assert engine.request("/health_generate", method="GET")[0] == 200
            engine.post("/begin_weight_update", {})
            update = pool.submit(
                engine.post,
                "/update_weights_from_distributed",
                {
                    "names": [PROBE],
                    "dtypes": ["float32"],
                    "shapes": [list(norm.shape)],
                    "group_name": group.group_name,
                },
            )
            wait_until(lambda: info(engine)["weight_receives"] == 1, what="the receive to block")
            started = time.monotonic()
            status = engine.request("/health_generate", method="GET", timeout=30)[0]
            assert status == 503 and time.monotonic() - started < HEALTH_TIMEOUT_S + 5
            assert not long.done()
            broadcast(norm.contiguous(), 0, group)  # the sender sends: the scheduler moves again
            assert update.result(timeout=60)["success"] is True
            engine.post("/end_weight_update", {})
            assert engine.request("/health_generate", method="GET", timeout=30)[0] == 200
            assert long.result(timeout=300)["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.request("/destroy_weights_update_group", {"group_name": group.group_name})
        destroy_weight_group(group)
    serves_v1(engine, models)


def info(engine: Engine) -> dict[str, Any]:
    return dict(engine.get("/get_server_info")["internal_states"][0])


def test_stalled_weight_group_setups_do_not_stall_generation(engine: Engine) -> None:
    """Six joins to an address that takes no connection: generation goes on, each join ends
    with an error within --weight-group-setup-timeout (or 503 at once beyond the setup slots),
    and the slots are free again once the address lets go."""
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(0)  # listens, never accepts
        port = sink.getsockname()[1]
        bodies = [
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": f"stall-{port}-{i}",
                "backend": "gloo",
            }
            for i in range(6)
        ]
        with ThreadPoolExecutor(6) as pool:
            started = time.monotonic()
            joins: list[Future[tuple[int, Any]]] = [
                pool.submit(engine.request, "/init_weights_update_group", b, "POST", 120) for b in bodies
            ]
            out = greedy(engine, 4)
            generated = time.monotonic() - started
            answers = [j.result(timeout=SETUP_TIMEOUT_S + 60) for j in joins]
            finished = time.monotonic() - started
    # The sink is closed: a join still waiting on it ends, and its slot with it.
    wait_until(lambda: info(engine)["weight_group_setups"] == 0, what="the stalled joins to end")
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert generated < SETUP_TIMEOUT_S  # answered while the joins were still waiting
    assert finished < SETUP_TIMEOUT_S + 30
    statuses = sorted(status for status, _ in answers)
    assert statuses == [400, 400, 503, 503, 503, 503], answers
    for status, body in answers:
        message = body["message"] if status == 400 else body["error"]["message"]
        flag = "--weight-group-setup-timeout" if status == 400 else "--max-weight-group-setups"
        assert flag in message, message
    group = join_group(engine, f"after-stall-{port}")  # the slots were given back
    engine.post("/destroy_weights_update_group", {"group_name": group.group_name})
    destroy_weight_group(group)


def test_oversized_bodies_and_too_many_prompts_are_refused(engine: Engine) -> None:
    big = b'{"text": "' + b"a" * (MAX_BODY + (1 << 20)) + b'"}'
    status, body = engine.request("/generate", big, timeout=120)
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]
    status, body = engine.request("/update_weights_from_disk", big, timeout=120)
    assert status == 413
    # Without a Content-Length (chunked), the limit holds while reading.
    conn = http.client.HTTPConnection("127.0.0.1", int(engine.url.rsplit(":", 1)[1]), timeout=120)
    try:
        chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
        headers = {"Authorization": f"Bearer {ENGINE_KEY}", "Content-Type": "application/json"}
        conn.request("POST", "/generate", body=chunks, headers=headers, encode_chunked=True)
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    assert replace(engine, api_key=None).request("/generate", big, timeout=120)[0] == 401
    sp = {"max_new_tokens": 1}
    for many in ({"input_ids": [[1, 2]] * (MAX_PROMPTS + 1)}, {"text": ["hi"] * (MAX_PROMPTS + 1)}):
        status, body = engine.request("/generate", {**many, "sampling_params": sp})
        assert status == 400 and "--max-prompts-per-request" in body["error"]["message"]
    ok = engine.post("/generate", {"input_ids": [[1, 2]] * MAX_PROMPTS, "sampling_params": sp})
    assert len(ok) == MAX_PROMPTS


def test_a_huge_text_does_not_stall_other_requests(engine: Engine) -> None:
    """10 MB of text takes seconds to tokenize; it happens beside the event loop, so a small
    request sent meanwhile answers at once."""
    huge = {"text": "hello world 12345 " * (10_000_000 // 18), "sampling_params": {"max_new_tokens": 1}}
    latencies: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(engine.request, "/generate", huge, "POST", 300)
        while not big.done():
            t = time.monotonic()
            greedy(engine, 1)
            latencies.append(time.monotonic() - t)
        status, body = big.result()
        elapsed = time.monotonic() - started
    assert status == 400 and "context length" in body["error"]["message"]  # tokenized, then refused
    assert elapsed > 3.0, "the text was too small to show anything"
    assert len(latencies) >= 3 and max(latencies) < 2.5, (elapsed, latencies)


def test_a_corrupt_checkpoint_is_a_400_naming_the_file(
    engine: Engine, models: tuple[str, str], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(models[1], broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    status, body = engine.request("/update_weights_from_disk", {"model_path": str(broken)})
    assert status == 400 and str(shard) in body["message"] and "safetensors" in body["message"]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    status, body = engine.request("/update_weights_from_disk", {"model_path": str(broken)})
    assert status == 400 and str(shard) in body["message"]
    assert greedy(engine)["meta_info"]["finish_reason"]["type"] == "length"
    serves_v1(engine, models)


# ----- engines of their own -----


def test_a_failed_scheduler_ends_the_engine_with_an_error(
    models: tuple[str, str], cpu_engine: EngineFactory, tmp_path: Path
) -> None:
    """NaN weights accepted on purpose (--allow-nonfinite-weights): the next sampled token
    raises in the model's sampler, which ends the scheduler. The request in flight answers,
    and the process exits 1 at once instead of answering health checks while hung."""
    eng = cpu_engine(model=models[0], allow_nonfinite_weights=True)
    poisoned = tmp_path / "poisoned"
    shutil.copytree(models[0], poisoned)
    save_file(with_nan(load_file(str(poisoned / "model.safetensors"))), str(poisoned / "model.safetensors"))
    eng.post("/update_weights_from_disk", {"model_path": str(poisoned)})
    assert eng.proc is not None
    started = time.monotonic()
    try:
        status, body = eng.request(
            "/generate",
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}},
        )
    except (ConnectionError, OSError):
        pass  # the process went first: also an answer, not a hang
    else:
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
        assert "the engine failed" in body["meta_info"]["finish_reason"]["message"]
    assert eng.proc.wait(timeout=60) == 1
    assert time.monotonic() - started < 60
    assert eng.log is not None and "the scheduler failed" in eng.log.read_text()


def test_the_engine_does_not_start_without_a_key(models: tuple[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENGINE_KEY_ENV}
    cmd = cpu_engine_launch(models[0], api_key=None).specs[0].argv  # the launcher's, with no key
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and ENGINE_KEY_ENV in proc.stderr and "--api-key-file" in proc.stderr
    key_file = write_key(tmp_path / "key", "f" * 24, 0o644)
    proc = subprocess.run(
        [*cmd, "--api-key-file", str(key_file)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "chmod 600" in proc.stderr


def test_engines_get_the_engine_key_and_not_the_run_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node agent leaves the run secret out of a process that does not speak tether's RPC,
    even when the agent's own environment holds it (SLURM, systemd); the engine key travels in
    the spec's environment. Checked on a real engine spec from the launcher."""
    monkeypatch.setenv(SECRET_ENV, new_secret().hex())
    launch = build_launch(
        local_plan_engine(),
        EngineLaunchConfig(model_path="/m", backend="cpu", device_kind="cpu", api_key=ENGINE_KEY),
    )
    show = "import os; print('secret', os.environ.get('TETHER_SECRET')); print('key', os.environ.get('%s'))"
    engine_like = msgspec.structs.replace(launch.specs[0], argv=[sys.executable, "-c", show % ENGINE_KEY_ENV])
    rpc_like = ProcessSpec(name="rank", argv=[sys.executable, "-c", show % ENGINE_KEY_ENV])

    async def main() -> None:
        async with Supervisor(tmp_path, new_secret(), grace=5.0) as sup:
            for spec in (engine_like, rpc_like):
                proc = await sup.start(spec, restartable=True)  # its exit is expected
                assert (await proc.wait()).returncode == 0

    run(main())
    engine_log = (tmp_path / "logs" / f"{engine_like.name}.log").read_text()
    rank_log = (tmp_path / "logs" / "rank.log").read_text()
    assert "secret None" in engine_log and f"key {ENGINE_KEY}" in engine_log
    assert "secret None" not in rank_log  # a trainer rank keeps it: it speaks the RPC


def test_a_stalled_join_does_not_keep_the_engine_from_stopping(
    models: tuple[str, str], cpu_engine: EngineFactory
) -> None:
    """A join whose peer takes the connection and never answers keeps its thread, which nothing
    can stop; SIGTERM still ends the engine at once (the owner replaces or stops it)."""
    eng = cpu_engine("--weight-group-setup-timeout", "1", model=models[0])
    held: list[socket.socket] = []
    try:
        with socket.socket() as sink:
            sink.bind(("127.0.0.1", 0))
            sink.listen(1)
            port = sink.getsockname()[1]
            taker = ThreadPoolExecutor(1)
            taking = taker.submit(lambda: held.append(sink.accept()[0]))  # accept, then silence
            body = {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": f"held-{port}",
                "backend": "gloo",
            }
            status, answer = eng.request("/init_weights_update_group", body, timeout=60)
            taking.result(timeout=30)
            taker.shutdown()
            assert status == 400 and "did not complete the rendezvous" in answer["message"]
            assert "--weight-group-setup-timeout" in answer["message"]
            assert info(eng)["weight_group_setups"] == 1  # its thread still waits on the peer
            assert eng.proc is not None
            eng.proc.terminate()
            assert eng.proc.wait(timeout=30) == 0
    finally:
        stop_engine(eng)
        for conn in held:
            conn.close()

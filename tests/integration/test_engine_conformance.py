"""One set of cases over SGLang's native API, parametrised by engine.

"cpu" is tether's embedded engine; "sglang" (marked `sglang`) is the real SGLang 0.5.x server
on CPU, run from the venv tests/support/sglang_env.sh builds and skipped, naming the missing venv, when
it is absent. Both start through tether's launcher (`tether.rollout.engine_api.launch`) under a
Supervisor, one server per param for the whole module. Cases assert the shared contract;
where a case reads state only one engine exposes, it says so. Cases that change the served
weights put v1 back before they return, so their order does not matter.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import uvloop
from safetensors.torch import load_file
from support.engines import (
    ENGINE_KEY,
    FAMILY_LAYERS,
    Engine,
    EngineFactory,
    decode_routed_experts,
    engine_client,
    find_sglang_python,
    hf_greedy,
    hf_logprobs,
    hf_routed_experts,
    make_models,
    start_supervised,
    wait_until,
)
from support.net import free_port

from tether.bench.engines.slow_engine import delay_argv
from tether.rollout.cpu_engine.modeling.tiny_model import ARCHES, TinyModelSpec, write_tiny_model
from tether.rollout.engine_api.weights import encode_named_tensors
from tether.runtime.weight_group import broadcast, destroy_weight_group, init_weight_group
from tether.sync.config import WeightSyncConfig
from tether.sync.ledger import LedgerEntry
from tether.sync.transports.distributed import DistributedTransport, flatten_bucket

PROMPTS = [[1, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [42]]
N = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", params=["cpu", pytest.param("sglang", marks=pytest.mark.sglang)])
def engine(
    request: pytest.FixtureRequest, models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    python = None
    if request.param == "sglang":
        python, missing = find_sglang_python()
        if python is None:
            pytest.skip(f"real SGLang unavailable: {missing}")
    # --enable-metrics: SGLang reports running/queued requests only on /metrics (see `running`).
    # --tool-call-parser: both engines read (and constrain) Qwen 2.5's tool-call format.
    extra = ["--tool-call-parser", "qwen25"]
    if request.param == "sglang":
        # --sleep-on-idle: the server lives to the module's end; idle, its scheduler would poll a
        # core the family cases below (CPU engine and transformers) need.
        extra += ["--enable-metrics", "--sleep-on-idle"]
    eng, stop = start_supervised(
        request.param, models[0], tmp_path_factory.mktemp("run"), sglang_python=python, sglang_args=extra
    )
    try:
        yield eng
    finally:
        stop()


def greedy(engine: Engine, prompt: list[int], n: int = N, **extra: Any) -> dict[str, Any]:
    payload = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return engine.post("/generate", {**payload, "return_logprob": True, **extra})


# Log-prob agreement with transformers in fp32. tether's engine runs the same torch ops; SGLang's
# torch-native kernels differ by up to ~2e-4 on the tiny models, so near-ties may break either way.
TOLERANCE = {"cpu": 1e-5, "sglang": 1e-3}


def assert_matches_hf(out: dict[str, Any], model_dir: str, prompt: list[int], tol: float) -> None:
    """Greedy output agrees with transformers: each token is an argmax (within `tol`) of the
    reference distribution given the engine's own prefix, and its reported log-prob matches."""
    ids = out["output_ids"]
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == ids and all(e[2] is None for e in entries)
    full = hf_logprobs(model_dir, prompt + ids)
    for j, (tok, entry) in enumerate(zip(ids, entries, strict=True)):
        row = full[len(prompt) - 1 + j]
        assert float(row[tok]) >= float(row.max()) - tol, f"token {j} ({tok}) is not greedy"
        assert abs(entry[0] - float(row[tok])) < tol, f"token {j}: {entry[0]} vs {float(row[tok])}"
    if tol <= 1e-5:  # exact-kernel engines must also reproduce transformers' tokens one for one
        assert ids == hf_greedy(model_dir, prompt, len(ids))[0]


def error_message(body: Any) -> str:
    """The message of an error answer in any of SGLang's shapes: {"error": {"message"}},
    {"error": "..."} (request validation) or {"message": ...} (FastAPI's 400 on bad JSON)."""
    assert isinstance(body, dict), body
    err = body.get("error")
    if isinstance(err, dict):
        return str(err["message"])
    if isinstance(err, str):
        return err
    return str(body["message"])


def restore_v1(engine: Engine, models: tuple[str, str]) -> None:
    engine.post("/update_weights_from_disk", {"model_path": models[0], "weight_version": "v1"})


def long_request(engine: Engine, rid: str, n: int = 1500) -> dict[str, Any]:
    sp = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    return engine.post(
        "/generate", {"rid": rid, "input_ids": [1, 2, 3], "sampling_params": sp, "return_logprob": True}
    )


def _metric(engine: Engine, name: str) -> float:
    status, text = engine.request("/metrics", method="GET")
    assert status == 200, text
    for line in str(text).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def running(engine: Engine) -> int:
    """Requests decoding now: tether's engine says so in /get_server_info, SGLang on /metrics."""
    if engine.kind == "sglang":
        return int(_metric(engine, "sglang:num_running_reqs"))
    return int(engine.get("/get_server_info")["internal_states"][0]["running"])


def queued(engine: Engine) -> int:
    if engine.kind == "sglang":
        return int(_metric(engine, "sglang:num_queue_reqs"))
    return int(engine.get("/get_server_info")["internal_states"][0]["waiting"])


def weight_version(engine: Engine) -> str:
    return str(engine.get("/get_model_info")["weight_version"])


def test_health_and_info(engine: Engine, models: tuple[str, str]) -> None:
    assert engine.request("/health", method="GET")[0] == 200
    assert engine.request("/health_generate", method="GET")[0] == 200
    info = engine.get("/get_model_info")
    assert info["model_path"] == models[0] and info["is_generation"] is True and "weight_version" in info
    assert "version" in engine.get("/get_server_info")
    if engine.kind == "cpu":  # a tether extension; SGLang 0.5.23 reports it in /get_model_info only
        assert engine.get("/get_weight_version")["weight_version"] == info["weight_version"]


def test_greedy_and_logprobs_equal_transformers(engine: Engine, models: tuple[str, str]) -> None:
    for prompt in PROMPTS:
        assert_matches_hf(greedy(engine, prompt), models[0], prompt, TOLERANCE[engine.kind])
    batch = engine.post(
        "/generate",
        {
            "input_ids": PROMPTS,
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for out, prompt in zip(batch, PROMPTS, strict=True):
        assert_matches_hf(out, models[0], prompt, TOLERANCE[engine.kind])
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == N
        assert meta["finish_reason"]["type"] == "length"


def test_prompt_scoring_input_token_logprobs(engine: Engine, models: tuple[str, str]) -> None:
    """slime's on-policy distillation asks a teacher server for this: the prompt's log-probs from
    logprob_start_len on (`input_token_logprobs`, the first entry without one), nothing generated."""
    prompt, tol = PROMPTS[1], TOLERANCE[engine.kind]
    full = hf_logprobs(models[0], prompt)
    for start in (0, 2):
        out = engine.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": 2,
            },
        )
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:] and all(e[2] is None for e in entries)
        assert entries[0][0] is None  # even when start > 0: SGLang's shape
        for j, entry in enumerate(entries[1:], start=start + 1):
            assert abs(entry[0] - float(full[j - 1, prompt[j]])) < tol, (start, j, entry)
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        assert all(abs(row[0][0] - float(full[start + i].max())) < tol for i, row in enumerate(tops[1:]))
        assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
    status, body = engine.request(
        "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt) + 1}
    )
    assert status == 400 and "logprob_start_len" in error_message(body)


def test_text_prompt_and_stream(engine: Engine) -> None:
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = engine.post("/generate", {"text": "hello world", "sampling_params": sp})
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 6
    events = engine.stream({"text": "hello world", "sampling_params": sp, "stream": True})
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["output_ids"] == out["output_ids"] and final["text"] == out["text"]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(events) >= 3  # more than one chunk before [DONE]


def test_group_batched_generate_equals_single_requests(engine: Engine) -> None:
    """A rollout group's prompts go as one batched /generate (SGLang's list form, sent by
    EngineClient for calls made together under one batch_key): each caller gets its own answer,
    under its own rid, equal to the answer of its prompt sent alone."""
    singles = [greedy(engine, p) for p in PROMPTS]
    rids = [f"batched-{i}" for i in range(len(PROMPTS))]
    params = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}

    async def body() -> list[Any]:
        async with engine_client(engine.url, name=engine.kind) as client:
            calls = [
                client.generate(p, params, rid=rid, batch_key="group-0")
                for p, rid in zip(PROMPTS, rids, strict=True)
            ]
            return list(await asyncio.gather(*calls))

    answers = uvloop.run(body())
    for single, answer, rid in zip(singles, answers, rids, strict=True):
        assert answer.output_ids == single["output_ids"]
        assert answer.meta_info.id == rid
        assert len(answer.meta_info.output_token_logprobs) == N


def test_sampling_seed_is_reproducible(engine: Engine) -> None:
    payload = {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": 11,
        },
    }
    a, b = engine.post("/generate", payload), engine.post("/generate", payload)
    assert len(a["output_ids"]) == len(b["output_ids"]) == 16
    # SGLang honours sampling_seed only with --enable-deterministic-inference, which needs a GPU
    # attention backend (not torch_native); tether's engine always does.
    if engine.kind == "cpu":
        assert a["output_ids"] == b["output_ids"]


def test_stop_token_and_stop_string(engine: Engine, models: tuple[str, str]) -> None:
    ref = greedy(engine, PROMPTS[0])["output_ids"]
    stop_id = ref[3]
    first = ref.index(stop_id)
    out = engine.post(
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "stop_token_ids": [stop_id]},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == ref[: first + 1]
    full_text = engine.post(
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True},
        },
    )["text"]
    stop = full_text[2:4] if len(full_text) >= 4 else full_text[-1:]
    out = engine.post(
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True, "stop": [stop]},
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and full_text.startswith(out["text"])


def test_errors_answer_like_sglang(engine: Engine) -> None:
    status, body = engine.request("/generate", b"{not json")
    assert status == 400 and error_message(body)
    status, body = engine.request(
        "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}}
    )
    assert status == 400 and error_message(body)
    if engine.kind == "cpu":  # tether names the field; SGLang says only 'invalid type: string "ten"'
        assert "max_new_tokens" in error_message(body)
    status, body = engine.request(
        "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}
    )
    assert status == 400 and "context length" in error_message(body)
    status, body = engine.request("/generate", {"input_ids": [1, 2], "return_logprob": "yes"})
    assert status == 400 and error_message(body)
    assert engine.request("/health", method="GET")[0] == 200  # still serving


# Every endpoint that changes what an engine serves, with a body it would act on.
MUTATIONS: list[tuple[str, Any]] = [
    ("/update_weights_from_disk", {"model_path": "<v2>", "weight_version": "stranger"}),
    ("/update_weight_version", {"new_version": "stranger", "abort_all_requests": True}),
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
    ("/abort_request", {"rid": "", "abort_all": True}),
    ("/flush_cache", {}),
    ("/begin_weight_update", {}),
    ("/end_weight_update", {}),
    ("/destroy_weights_update_group", {"group_name": "weight_update_group"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]}),
    (
        "/update_weights_from_distributed",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
    ),
    ("/update_weights_from_distributed_stream", {"flattened": True}),  # tether's streamed update
    ("/release_memory_occupation", {}),
    ("/resume_memory_occupation", {}),
    ("/weights_checker", {"action": "reset_tensors"}),  # would overwrite every weight with noise
]


def test_every_endpoint_but_health_needs_the_key(engine: Engine, models: tuple[str, str]) -> None:
    """A caller without the engine key (or with a wrong one) gets 401 and changes nothing:
    not the weights, the version, the pause state or a request in flight."""
    weights = {"name": "model.embed_tokens.weight", "truncate_size": 2}  # differs between v1 and v2
    before = engine.post("/get_weights_by_name", weights)
    version = weight_version(engine)
    group_port = free_port()
    join = {
        "master_address": "127.0.0.1",
        "master_port": group_port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": f"stranger-{group_port}",
        "backend": "gloo",
    }
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(long_request, engine, "kept-running", 300)
        wait_until(lambda: running(engine) >= 1, what="request running")
        for key in (None, "wrong-" + "k" * 20):
            stranger = replace(engine, api_key=key)
            for path, body in [*MUTATIONS, ("/init_weights_update_group", join)]:
                if path == "/update_weights_from_disk":
                    body = {**body, "model_path": models[1]}
                status, _ = stranger.request(path, body)
                assert status == 401, f"{path} without the key answered {status}"
            for path in ("/generate", "/get_weights_by_name"):
                status, _ = stranger.request(path, {"input_ids": [1, 2], "name": "model.norm.weight"})
                assert status == 401, f"{path} without the key answered {status}"
            for path in ("/get_model_info", "/get_server_info"):
                assert stranger.request(path, method="GET")[0] == 401, path
            assert stranger.request("/health", method="GET")[0] == 200  # the one open probe
        out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # neither aborted nor paused
    assert weight_version(engine) == version
    assert engine.post("/get_weights_by_name", weights) == before
    assert greedy(engine, PROMPTS[0], 2)["meta_info"]["finish_reason"]["type"] == "length"
    if engine.kind == "sglang":
        # Started with the key (through tether's shim), SGLang logs its arguments: redacted.
        assert engine.log is not None and ENGINE_KEY not in engine.log.read_text()
        assert "<redacted>" in engine.log.read_text()
    if engine.kind == "cpu":
        # SGLang leaves /health* open to probes; tether's engine opens only /health.
        assert replace(engine, api_key=None).request("/health_generate", method="GET")[0] == 401
        assert engine.get("/get_server_info")["internal_states"][0]["paused"] is False


def test_continuous_batching_joins_running_batch(engine: Engine) -> None:
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(long_request, engine, "cb-long", 2000)
        wait_until(lambda: running(engine) >= 1, what="long request running")
        short = greedy(engine, [4, 5], n=4)
        assert not long.done()  # the short request finished while the long one was decoding
        engine.post("/abort_request", {"rid": "cb-long"})
        assert long.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(short["output_ids"]) == 4


def test_abort_mid_generation(engine: Engine) -> None:
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(long_request, engine, "abort-me", 2000)
        wait_until(lambda: running(engine) >= 1, what="request running")
        engine.post("/abort_request", {"rid": "abort-me"})
        out = fut.result(timeout=60)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 2000
    assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])


def test_pause_abort_retract_in_place_and_continue(engine: Engine) -> None:
    # abort: in-flight requests end with finish_reason abort
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(long_request, engine, "p-abort", 2000)
        wait_until(lambda: running(engine) >= 1, what="request running")
        engine.post("/pause_generation", {"mode": "abort"})
        assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
        # while paused, a new request waits; it completes after continue
        try:
            waiting = pool.submit(greedy, engine, PROMPTS[0])
            if engine.kind == "cpu":  # SGLang holds it before its scheduler, where no counter sees it
                wait_until(lambda: queued(engine) >= 1, what="queued")
            assert not waiting.done()
        finally:
            engine.post("/continue_generation", {})
        assert len(waiting.result(timeout=60)["output_ids"]) == N
    reference = greedy(engine, PROMPTS[1], n=300)["output_ids"]
    for mode in ("retract", "in_place"):
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(greedy, engine, PROMPTS[1], 300)
            wait_until(lambda: running(engine) >= 1, what="request running")
            engine.post("/pause_generation", {"mode": mode})
            if engine.kind == "cpu":  # only tether's engine exposes its step counter
                steps = engine.get("/get_server_info")["internal_states"][0]["steps"]
                assert engine.get("/get_server_info")["internal_states"][0]["steps"] == steps
            assert not fut.done()
            engine.post("/continue_generation", {})
            out = fut.result(timeout=60)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["output_ids"] == reference, mode


def test_update_weights_from_disk(engine: Engine, models: tuple[str, str]) -> None:
    body = engine.post("/update_weights_from_disk", {"model_path": models[1], "weight_version": "v2"})
    assert body["success"] is True
    try:
        out = greedy(engine, PROMPTS[0])
        assert out["meta_info"]["weight_version"] == "v2"
        assert_matches_hf(out, models[1], PROMPTS[0], TOLERANCE[engine.kind])
        assert weight_version(engine) == "v2"
        status, body = engine.request(
            "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "bad"}
        )
        assert status == 400 and body["success"] is False
        assert greedy(engine, PROMPTS[0])["meta_info"]["weight_version"] == "v2"
    finally:
        restore_v1(engine, models)
    assert_matches_hf(greedy(engine, PROMPTS[0]), models[0], PROMPTS[0], TOLERANCE[engine.kind])


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_distributed(
    engine: Engine, models: tuple[str, str], load_format: str | None
) -> None:
    """Tensor by tensor, or (flattened_bucket) every tensor's bytes in one broadcast, packed
    the way tether's sender packs them."""
    new = load_file(str(Path(models[1]) / "model.safetensors"))
    names = sorted(new)
    port = free_port()
    group_name = f"conformance-{port}"
    # Outside a begin/end session the update is refused (SGLang 0.5.23 does the same).
    status, body = engine.request(
        "/update_weights_from_distributed",
        {
            "names": names,
            "dtypes": ["float32"] * len(names),
            "shapes": [list(new[n].shape) for n in names],
            "group_name": group_name,
        },
    )
    assert status == 400 and "begin_weight_update" in body["message"]
    with ThreadPoolExecutor(2) as pool:
        init = pool.submit(
            engine.post,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group_name,
                "backend": "gloo",
            },
        )
        # Collectives bounded at a minute: an engine that refuses the update before receiving
        # leaves this side's broadcast waiting for a peer that never comes.
        group = init_weight_group(
            f"tcp://127.0.0.1:{port}", 0, 2, group_name, "gloo", timeout=timedelta(seconds=60)
        )
        assert init.result(timeout=60)["success"] is True
        try:
            engine.post("/begin_weight_update", {})
            update = pool.submit(
                engine.post,
                "/update_weights_from_distributed",
                {
                    "names": names,
                    "dtypes": ["float32"] * len(names),
                    "shapes": [list(new[n].shape) for n in names],
                    "group_name": group_name,
                    "weight_version": "dist-v2",
                    "flush_cache": True,
                    "load_format": load_format,
                },
            )

            def send() -> None:
                if load_format == "flattened_bucket":
                    broadcast(flatten_bucket([(n, new[n].contiguous()) for n in names]), 0, group)
                else:
                    for name in names:
                        broadcast(new[name].contiguous(), 0, group)

            sending = pool.submit(send)
            # The engine's answer as soon as it comes: a refusal is the failure to show, not the
            # broadcast's timeout behind it.
            wait([update, sending], timeout=120, return_when=FIRST_COMPLETED)
            if update.done():
                assert update.result()["success"] is True  # a refusal raises here, with its message
            sending.result(timeout=60)
            assert update.result(timeout=60)["success"] is True
            engine.post("/end_weight_update", {})
            out = greedy(engine, PROMPTS[1])
            assert out["meta_info"]["weight_version"] == "dist-v2"
            assert_matches_hf(out, models[1], PROMPTS[1], TOLERANCE[engine.kind])
            if engine.kind == "cpu":
                # A group name is usable once per server. SGLang 0.5.23 on CPU does not answer a
                # reused name before its rendezvous times out (minutes), so only tether's is asked.
                status, _ = engine.request(
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": free_port(),
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": group_name,
                        "backend": "gloo",
                    },
                )
                assert status == 400
            engine.post("/destroy_weights_update_group", {"group_name": group_name})
        finally:
            destroy_weight_group(group)
            restore_v1(engine, models)


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_distributed_transport_pipelines_buckets(
    engine: Engine, models: tuple[str, str], flattened: bool
) -> None:
    """tether's sender as the trainer runs it: pause, session, several buckets whose requests
    are pipelined (bucket k+1 goes out before bucket k is answered), version, continue."""
    new = load_file(str(Path(models[1]) / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in new.values())
    sync_cfg = WeightSyncConfig(
        update_weight_buffer_size=total // 4 + 1,
        update_weight_flattened_bucket=flattened,
        update_weight_request_timeout=120.0,
        update_weight_collective_timeout=120.0,
    )

    async def body() -> LedgerEntry:
        async with engine_client(engine.url, name=engine.kind) as client:
            sender = DistributedTransport([client], sync_cfg, master_port=free_port())
            try:
                return await sender.sync(7, iter(sorted(new.items())))
            finally:
                await sender.close()

    try:
        entry = uvloop.run(body())
        assert entry.ok and entry.engine_versions == {engine.kind: 7}
        out = greedy(engine, PROMPTS[2])
        assert out["meta_info"]["weight_version"] == "7"
        assert_matches_hf(out, models[1], PROMPTS[2], TOLERANCE[engine.kind])
    finally:
        restore_v1(engine, models)


def test_update_weights_from_tensor_and_rejections(engine: Engine, models: tuple[str, str]) -> None:
    new = load_file(str(Path(models[1]) / "model.safetensors"))
    tensors = [(name, t) for name, t in new.items()]
    alive: list[torch.Tensor] = []  # the shared copies live until the engine has answered
    payload = {
        "serialized_named_tensors": [encode_named_tensors(tensors, alive)],
        "weight_version": "tensor-v2",
        "flush_cache": True,
    }
    try:
        # SGLang 0.5.23 accepts tensor updates only inside a begin/end weight-update session.
        engine.post("/begin_weight_update", {})
        assert engine.post("/update_weights_from_tensor", payload)["success"] is True
        engine.post("/end_weight_update", {})
        out = greedy(engine, PROMPTS[2])
        assert out["meta_info"]["weight_version"] == "tensor-v2"
        assert_matches_hf(out, models[1], PROMPTS[2], TOLERANCE[engine.kind])
        got = engine.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
        assert got == pytest.approx(new["model.norm.weight"][:5].tolist())
        if engine.kind == "sglang":
            return  # SGLang 0.5.23's scheduler dies on a wrong-shaped tensor; tether's engine refuses it
        # Outside a weight-update session the update is refused, as SGLang refuses it.
        status, body = engine.request("/update_weights_from_tensor", payload)
        assert status == 400 and "begin_weight_update" in body["message"]
        # Wrong shape, unknown name: rejected and the current weights keep serving.
        engine.post("/begin_weight_update", {})
        for bad in (
            [("model.norm.weight", torch.ones(3))],
            [("model.not_a_weight", torch.ones(64))],
        ):
            status, body = engine.request(
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [encode_named_tensors(bad, alive)], "weight_version": "bad"},
            )
            assert status == 400 and body["success"] is False and "begin_weight_update" not in body["message"]
        # A pickle naming anything but torch's tensor rebuilders is refused by name.
        evil = base64.b64encode(pickle.dumps(threading.Thread)).decode()
        status, body = engine.request("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
        assert status == 400 and "threading.Thread" in body["message"]
        engine.post("/end_weight_update", {})
        after = greedy(engine, PROMPTS[2])
        assert (
            after["meta_info"]["weight_version"] == "tensor-v2" and after["output_ids"] == out["output_ids"]
        )
    finally:
        restore_v1(engine, models)


def test_update_weight_version_and_in_flight_request(engine: Engine, models: tuple[str, str]) -> None:
    assert engine.post("/update_weight_version", {"new_version": "named-1"})["new_version"] == "named-1"
    assert weight_version(engine) == "named-1"
    if engine.kind == "sglang":
        # SGLang 0.5.23 on CPU: an update from disk under a decoding request answers 400 (weights
        # updated, cache not flushed); with flush_cache=false the request then did not finish.
        # RL updates pause generation first (see the pause case); the in-flight path is tether's.
        return
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(long_request, engine, "across-update", 1500)
        wait_until(lambda: running(engine) >= 1, what="request running")
        engine.post("/update_weights_from_disk", {"model_path": models[1], "weight_version": "mid-v2"})
        out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_version"] == "mid-v2"  # the version it finished under
    restore_v1(engine, models)


SGLANG_CPU_COMPARE = (
    "SGLang's /weights_checker compare copies each tensor to CUDA (weight_checker_comparator's "
    "RawComparable.iter_chunks calls .cuda()); on CPU it answers 400 'Found no NVIDIA driver'"
)


def test_weights_checker_snapshot_reset_compare(engine: Engine, models: tuple[str, str]) -> None:
    """SGLang's /weights_checker as slime's --check-weight-update-equal drives it: snapshot, noise,
    a weight update, compare (400 naming each tensor that differs, 200 when all are equal)."""
    assert engine.post("/weights_checker", {"action": "snapshot"}) == {"success": True, "message": "Success."}
    try:
        engine.post("/weights_checker", {"action": "reset_tensors"})
        noise = greedy(engine, PROMPTS[0], n=4)["output_ids"]
        assert noise != hf_greedy(models[0], PROMPTS[0], 4)[0]  # the engine really serves the noise
        engine.post("/update_weights_from_disk", {"model_path": models[1], "weight_version": "v2"})
        status, body = engine.request("/weights_checker", {"action": "compare"})
        assert status == 400 and body["success"] is False, body
        if engine.kind == "sglang" and "NVIDIA" in body["message"]:
            pytest.skip(SGLANG_CPU_COMPARE)  # snapshot and reset_tensors were checked (v1 comes back below)
        assert body["message"].startswith("check tensor equality failed:\nname="), body["message"]
        assert "\nname=model.layers.0.self_attn.q_proj.weight max_abs_err=" in body["message"]
        restore_v1(engine, models)  # the update that reproduces what the engine loaded
        assert engine.post("/weights_checker", {"action": "compare"}) == {
            "success": True,
            "message": "Success.",
        }
    finally:
        restore_v1(engine, models)
    status, body = engine.request("/weights_checker", {"action": "no_such_action"})
    assert status == 400 and "Unsupported action='no_such_action'" in body["message"]


def test_release_and_resume_memory(engine: Engine, models: tuple[str, str]) -> None:
    if engine.kind == "sglang":
        # SGLang releases memory through torch_memory_saver, which needs CUDA; on CPU the
        # request ends the server. The GPU suite covers it.
        pytest.skip("SGLang's /release_memory_occupation needs CUDA (torch_memory_saver)")
    engine.post("/release_memory_occupation", {})
    status, body = engine.request(
        "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 400 and "released" in body["error"]["message"]
    assert engine.request("/get_weights_by_name", {"name": "model.norm.weight"})[0] == 400  # really dropped
    engine.post("/resume_memory_occupation", {})
    assert_matches_hf(greedy(engine, PROMPTS[0]), models[0], PROMPTS[0], TOLERANCE[engine.kind])
    flush = engine.request("/flush_cache", b"", method="POST")
    assert flush[0] == 200 and isinstance(flush[1], str)


def test_slow_engine_delay(slow_engine: EngineFactory) -> None:
    """The benchmarks' slow engine: the seeded per-request delay holds each request before it joins
    the batch."""
    eng = slow_engine(*delay_argv("constant", 300, seed=1))
    out = eng.post(
        "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    )
    assert out["meta_info"]["e2e_latency"] >= 0.3


# ----- OpenAI-compatible endpoints (/v1/*), through the official `openai` client -----

CHAT = [{"role": "user", "content": "hi"}]
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Check that the service answers.",
        "parameters": {"type": "object", "properties": {}},
    },
}
# A random tiny model emits no tool call by chance; tool_choice "required" or a named function
# makes both engines constrain the output to Qwen 2.5's call format (SGLang through xgrammar's
# structural tag; with a non-strict function the arguments are any JSON value).
CALL_TOKENS = 64  # `<tool_call>\n{"name":"ping", "arguments":` is ~35 tokens on the byte-level tokenizer


def oai(engine: Engine, key: str | None = ENGINE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key=key, max_retries=0, timeout=120)


def chat_template_ids(model_dir: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' rendering of `messages` with the model's chat template (the reference prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def assert_logprobs_close(got: list[float], ref: list[float], tol: float) -> None:
    assert len(got) == len(ref)
    assert all(abs(a - b) < tol for a, b in zip(got, ref, strict=True)), (got, ref)


def test_openai_models_and_key(engine: Engine, models: tuple[str, str]) -> None:
    with oai(engine) as client:
        listed = client.models.list()
        assert [m.id for m in listed.data] == [models[0]] and listed.data[0].object == "model"
    with oai(engine, "wrong-" + "k" * 20) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model="default", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model="default", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    keyless = replace(engine, api_key=None)
    assert keyless.request("/v1/models", method="GET")[0] == 401
    assert keyless.request("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 401
    assert keyless.request("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})[0] == 401


def test_openai_completions(engine: Engine) -> None:
    tol = max(TOLERANCE[engine.kind], 1e-4)
    prompt = PROMPTS[0]
    ref = greedy(engine, prompt)
    ref_lps = [e[0] for e in ref["meta_info"]["output_token_logprobs"]]
    extra = {"return_token_ids": True, "ignore_eos": True}
    with oai(engine) as client:
        out = client.completions.create(
            model="default", prompt=prompt, max_tokens=N, temperature=0, n=2, logprobs=2, extra_body=extra
        )
        assert out.object == "text_completion" and out.id and len(out.choices) == 2
        for i, choice in enumerate(out.choices):
            assert choice.index == i and choice.finish_reason == "length" and choice.text == ref["text"]
            assert (choice.model_extra or {})["token_ids"] == ref["output_ids"]
            assert (choice.model_extra or {})["prompt_token_ids"] == prompt
            lp = choice.logprobs
            assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
            assert_logprobs_close(lp.token_logprobs, ref_lps, tol)
            for token, value, top in zip(lp.tokens or [], lp.token_logprobs, lp.top_logprobs, strict=True):
                assert 1 <= len(top) <= 2 and abs(top[token] - value) < tol  # greedy: the top token
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 2 * N)
        # text prompt, streamed: the chunks add up to the whole answer
        text_args: dict[str, Any] = {
            "model": "default",
            "prompt": "hello world",
            "max_tokens": 6,
            "temperature": 0,
        }
        whole = client.completions.create(**text_args, extra_body=extra).choices[0]
        chunks = list(
            client.completions.create(
                **text_args, stream=True, stream_options={"include_usage": True}, extra_body=extra
            )
        )
    parts = [c.choices[0] for c in chunks if c.choices]
    streamed_ids = [t for p in parts for t in (p.model_extra or {}).get("token_ids") or []]
    assert streamed_ids == (whole.model_extra or {})["token_ids"]
    assert "".join(p.text for p in parts) == whole.text
    assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    events = engine.stream({**text_args, "stream": True, **extra}, path="/v1/completions")
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])


def test_openai_seed_is_reproducible(engine: Engine) -> None:
    args: dict[str, Any] = {"model": "default", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    with oai(engine) as client:
        a = client.completions.create(prompt=[1, 2, 3], **args, extra_body={"ignore_eos": True})
        b = client.completions.create(prompt=[1, 2, 3], **args, extra_body={"ignore_eos": True})
        c = client.chat.completions.create(messages=CHAT, **args, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        d = client.chat.completions.create(messages=CHAT, **args, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert a.usage is not None and a.usage.completion_tokens == 8
    # As with /generate: SGLang honours the seed only with --enable-deterministic-inference, which
    # needs a GPU attention backend; tether's engine always does.
    if engine.kind == "cpu":
        assert a.choices[0].text == b.choices[0].text
        assert c.choices[0].message.content == d.choices[0].message.content


def test_openai_chat(engine: Engine, models: tuple[str, str]) -> None:
    tol = max(TOLERANCE[engine.kind], 1e-4)
    expected = chat_template_ids(models[0], CHAT)
    ref = greedy(engine, expected)
    ref_lps = [e[0] for e in ref["meta_info"]["output_token_logprobs"]]
    extra = {"return_token_ids": True, "return_meta_info": True, "ignore_eos": True}
    with oai(engine) as client:
        out = client.chat.completions.create(
            model="default",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=N,
            temperature=0,
            n=2,
            logprobs=True,
            top_logprobs=2,
            extra_body=extra,
        )
        assert out.object == "chat.completion" and len(out.choices) == 2
        for i, choice in enumerate(out.choices):
            more = choice.model_extra or {}
            assert choice.index == i and choice.finish_reason == "length"
            assert choice.message.role == "assistant" and choice.message.content == ref["text"]
            assert (
                more["prompt_token_ids"] == expected
            )  # the model's chat template, as transformers renders it
            assert more["response_token_ids"] == ref["output_ids"]  # the tokens sampled, not re-tokenized
            meta = more["meta_info"]
            assert [e[1] for e in meta["output_token_logprobs"]] == ref["output_ids"]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            content = choice.logprobs.content
            assert_logprobs_close([t.logprob for t in content], ref_lps, tol)
            assert_logprobs_close(
                [t.logprob for t in content], [e[0] for e in meta["output_token_logprobs"]], 1e-6
            )
            for t in content:
                assert len(t.top_logprobs) == 2 and abs(t.top_logprobs[0].logprob - t.logprob) < tol
                assert isinstance(t.bytes, list) and t.bytes
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected), 2 * N)
        # the tools are rendered by the chat template (unless tool_choice is "none")
        with_tools = client.chat.completions.create(
            model="default",
            messages=CHAT,  # type: ignore[arg-type]
            tools=[TOOL],  # type: ignore[list-item]
            max_tokens=1,
            extra_body={"return_prompt_token_ids": True},
        )
        ids = (with_tools.choices[0].model_extra or {})["prompt_token_ids"]
        assert ids != expected and len(ids) > len(expected)
        if engine.kind == "cpu":  # SGLang renders its own normalisation of the tool (null fields added)
            assert ids == chat_template_ids(models[0], CHAT, tools=[TOOL])
        # streamed: the role first, then the content, the finish reason, the ids and the usage
        chunks = list(
            client.chat.completions.create(
                model="default",
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=N,
                temperature=0,
                stream=True,
                logprobs=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_output_ids_in_sglext": True},
            )
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.delta.content or "" for p in parts) == ref["text"]
    assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]
    streamed_lps = [t.logprob for p in parts if p.logprobs and p.logprobs.content for t in p.logprobs.content]
    assert_logprobs_close(streamed_lps, ref_lps, tol)
    sglext = [(c.model_extra or {}).get("sglext") for c in chunks]
    assert [s["output_ids"] for s in sglext if s] == [[ref["output_ids"]]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == N
    events = engine.stream({"messages": CHAT, "max_tokens": 2, "stream": True}, path="/v1/chat/completions")
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_openai_tool_choice_forces_a_call(engine: Engine) -> None:
    named = {"type": "function", "function": {"name": "ping"}}
    args: dict[str, Any] = {"model": "default", "messages": CHAT, "tools": [TOOL], "temperature": 0}
    with oai(engine) as client:
        for choice in (named, "required"):
            out = client.chat.completions.create(**args, tool_choice=choice, max_tokens=CALL_TOKENS)
            answer = out.choices[0]
            calls = answer.message.tool_calls
            assert calls, f"tool_choice={choice!r}: no tool call in {answer.message}"
            call = calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name == "ping"  # type: ignore[union-attr]
            json.loads(call.function.arguments)  # type: ignore[union-attr]
            assert answer.message.content in ("", None)
            # SGLang's structural tag lets free text follow the call, so `length` is common
            assert answer.finish_reason in ("tool_calls", "length")
        chunks = list(
            client.chat.completions.create(**args, tool_choice=named, max_tokens=CALL_TOKENS, stream=True)  # type: ignore[call-overload]
        )
        plain = client.chat.completions.create(**args, tool_choice="none", max_tokens=4)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function is not None and deltas[0].function.name == "ping"
    json.loads("".join(d.function.arguments or "" for d in deltas if d.function))
    assert not plain.choices[0].message.tool_calls
    if engine.kind == "cpu":
        # A strict function's schema is enforced. (SGLang's xgrammar allows any whitespace in the
        # JSON, in which a random model stays until max_tokens; tether's grammar is compact JSON.)
        strict = {
            "type": "function",
            "function": {
                "name": "weather",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                    "required": ["city"],
                },
            },
        }
        with oai(engine) as client:
            out = client.chat.completions.create(
                model="default",
                messages=CHAT,  # type: ignore[arg-type]
                tools=[strict],  # type: ignore[list-item]
                tool_choice="required",
                max_tokens=96,  # a longer name and its arguments
            )
        calls = out.choices[0].message.tool_calls
        assert calls and json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


# (path, body, the field a CPU engine's message names); SGLang answers each with 400 as well.
BAD_OPENAI: list[tuple[str, Any, str]] = [
    ("/v1/chat/completions", b"{not json", "JSON"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": "two"}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**6}, "max_completion_tokens"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "stream": True, "return_token_ids": True},
        "return_token_ids",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "nope",
    ),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -2}, "temperature"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
]


def test_openai_bad_parameters_answer_400(engine: Engine) -> None:
    for path, body, field in BAD_OPENAI:
        status, answer = engine.request(path, body)
        assert status == 400, f"{path} {body!r} answered {status}: {answer}"
        message = error_message(answer)
        if engine.kind == "cpu":
            assert field in message, f"{path} {body!r}: {message!r} does not name {field!r}"
    with oai(engine) as client:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="default", messages=CHAT, temperature=-1)  # type: ignore[arg-type]
        ok = client.chat.completions.create(model="default", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert ok.choices[0].finish_reason in ("length", "stop")  # still serving
    if engine.kind == "cpu":  # tether's limits hold for /v1/* as for /generate (prompts x n)
        status, answer = engine.request("/v1/completions", {"prompt": ["a", "b"], "n": 300, "max_tokens": 1})
        assert status == 400 and "--max-prompts-per-request" in error_message(answer)


def test_openai_turns_become_one_sample(engine: Engine, models: tuple[str, str]) -> None:
    """Two chat turns with a tool result between them: the Sample holds the sampled tokens and
    log-probs of both turns, and only they train."""
    from transformers import AutoTokenizer

    from tether.rollout.openai_turns import Turn, continuation_ids, sample_from_turns

    tok = AutoTokenizer.from_pretrained(models[0])
    asked = {"return_token_ids": True, "ignore_eos": True}
    with oai(engine) as client:
        first = client.chat.completions.create(
            model="default",
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            extra_body=asked,  # type: ignore[arg-type]
        )
        one = Turn.from_response(first)
        tool_result = [{"role": "tool", "content": "pong", "tool_call_id": "call_1"}]
        prompt2 = continuation_ids(tok, [*one.prompt_token_ids, *one.output_token_ids], tool_result)
        messages = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content}, *tool_result]
        second = client.chat.completions.create(
            model="default",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            logprobs=True,
            extra_body={**asked, "input_ids": prompt2},
        )
    two = Turn.from_response(second)
    assert two.prompt_token_ids == prompt2
    sample = sample_from_turns([one, two], prompt=CHAT)
    glue = prompt2[len(one.prompt_token_ids) + 5 :]
    assert tok.decode(glue).startswith(("\n<|im_start|>user\n<tool_response>\npong", "<|im_end|>"))
    assert sample.tokens == [*prompt2, *two.output_token_ids]
    assert sample.response_length == 5 + len(glue) + 4
    assert sample.loss_mask == [1] * 5 + [0] * len(glue) + [1] * 4
    assert sample.rollout_log_probs == [*one.output_log_probs, *[0.0] * len(glue), *two.output_log_probs]
    # the log-probs are the engine's own, for the very tokens sampled
    ref = greedy(engine, one.prompt_token_ids, n=5)
    assert one.output_token_ids == ref["output_ids"]
    assert_logprobs_close(
        one.output_log_probs, [e[0] for e in ref["meta_info"]["output_token_logprobs"]], 1e-4
    )


def test_router_front_forwards_openai(engine: Engine) -> None:
    """tether's router front passes /v1/* to an engine (adding the key), streams included."""
    from tether.rollout.routing.front import RouterFront
    from tether.rollout.routing.router import Router

    async def scenario() -> None:
        router = Router([engine_client(engine.url, name="engine0")])
        async with router, RouterFront(router) as front:
            async with openai.AsyncOpenAI(
                base_url=f"{front.url}/v1", api_key="the-front-adds-the-engine-key", max_retries=0
            ) as client:
                listed = await client.models.list()
                assert len(listed.data) == 1
                out = await client.chat.completions.create(
                    model="default",
                    messages=CHAT,
                    max_tokens=3,
                    temperature=0,
                    extra_body={"ignore_eos": True},  # type: ignore[arg-type]
                )
                assert out.usage is not None and out.usage.completion_tokens == 3
                stream = await client.chat.completions.create(
                    model="default",
                    messages=CHAT,
                    max_tokens=3,
                    stream=True,
                    extra_body={"ignore_eos": True},  # type: ignore[arg-type]
                )
                finishes = [c.choices[0].finish_reason async for c in stream if c.choices]
                assert finishes[-1] == "length"
                with pytest.raises(openai.BadRequestError):  # the engine's 400 stays a 400
                    await client.chat.completions.create(model="default", messages=[])
            assert router.stats()[0].requests == 4

    uvloop.run(scenario())


# ----- model families: every `tether init-model --arch` family, MoE and multi-latent attention -----

FAMILIES = list(ARCHES)

SGLANG_CPU_CANNOT = {
    "deepseek_v3": "SGLang 0.5.23's CPU rotary embedding (get_rope_cpu, used by its MLA attention) "
    "asserts that rope_scaling is set; DeepSeek-V3 checkpoints carry yarn, the tiny model has none",
    "deepseek_v3_yarn": "SGLang 0.5.23's CPU build starts and serves it (with topk_method, "
    "scoring_func and moe_layer_freq in config.json), but its first greedy token is not "
    "transformers' argmax (log-prob -5.82 against the best -5.36); not root-caused (its CPU MLA, "
    "deepseek_yarn rope and grouped routing are all candidates)",
    "mimo": "SGLang 0.5.23 reads config.json with transformers' AutoConfig, which has no 'mimo' "
    "(MiMo's hub checkpoints ship remote code through auto_map; the tiny model has none)",
    "kimi_k2": "SGLang reads config.json with transformers' AutoConfig, which has no 'kimi_k2' "
    "(Kimi-K2's hub checkpoints ship remote code through auto_map; the tiny model has none)",
    "glm4_moe_lite": "not run against SGLang's CPU build: its multi-latent attention is the one "
    "deepseek_v3's entry names (CPU rotary embedding asserting rope_scaling), and the tiny model "
    "has no rope_scaling",
    "minimax_m2": "SGLang 0.5.23's MiniMax-M2 attention computes its all-head QK norm with a "
    "CUDA kernel (models/minimax_m2.py rms_sumsq_serial asserts x.is_cuda): its CPU build cannot "
    "run the model's first forward",
    "qwen2_moe": "SGLang 0.5.23 gates Qwen2-MoE's shared expert with a Triton kernel "
    "(fused_gate_sigmoid_mul_add), which finds no driver on CPU",
    "qwen3_next": "SGLang's Qwen3-Next (models/qwen3_next.py) runs its gated delta net through "
    "the hybrid linear-attention backend's FLA Triton kernels (chunk_gated_delta_rule, causal "
    "conv1d, the gated RMSNorm), which find no driver on CPU (read from its source; not started here)",
    "qwen3_5": "SGLang's Qwen3.5 (models/qwen3_5.py) runs its gated delta net through the same hybrid "
    "linear-attention backend as Qwen3-Next (FLA Triton kernels), which finds no driver on CPU "
    "(read from its source; not started here)",
    "qwen3_5_moe": "as qwen3_5: the hybrid linear-attention backend's FLA Triton kernels find no driver "
    "on CPU (read from its source; not started here)",
    "glm_moe_dsa": "SGLang 0.5.23 serves GLM-5 and DeepSeek-V3.2 only on its 'dsa' attention backend "
    "(arg_groups/model_overrides/deepseek_v2.py sets it for every DSA checkpoint), whose indexer and "
    "sparse MLA run Triton, DeepGEMM and FlashMLA kernels (layers/attention/dsa_backend.py, "
    "dsa/dsa_indexer.py): no CPU path (read from its source; not started here)",
    "deepseek_v32": "as glm_moe_dsa: SGLang's 'dsa' attention backend (Triton, DeepGEMM and FlashMLA "
    "kernels) has no CPU path (read from its source; not started here)",
}
# Variants of a family: the family's tiny model with config.json keys replaced. deepseek_v3_yarn
# carries YaRN as DeepSeek-V3's own config.json does (`rope_scaling`, `type`), with mscale and
# mscale_all_dim both set (the tables unscaled, the softmax scale multiplied by mscale_all_dim's
# factor squared).
FAMILY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3_yarn": (
        "deepseek_v3",
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            # DeepSeek-V3's config.json has these (transformers 5 dropped them); SGLang's model reads them.
            "moe_layer_freq": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    ),
}
ROUTED_EXPERTS_NO_CPU = (
    "SGLang 0.5.23's --enable-return-routed-experts allocates its host buffer with CUDA host "
    "registration (state_capturer/base.py BaseHostCache): 'Found no NVIDIA driver' on a CPU build"
)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """The tiny model of each family (and seed), written once per module by `tether init-model`'s code."""
    built: dict[tuple[str, int], str] = {}

    def get(arch: str, seed: int = 0) -> str:
        if (arch, seed) not in built:
            family, change = FAMILY_VARIANTS.get(arch, (arch, {}))
            spec = TinyModelSpec(arch=family, layers=FAMILY_LAYERS.get(family, 2), seed=seed)  # type: ignore[arg-type]
            path = write_tiny_model(tmp_path_factory.mktemp(f"{arch}-{seed}"), spec)
            if change:
                raw = json.loads((path / "config.json").read_text())
                raw.pop("rope_parameters", None)  # the variant states its RoPE the older way
                raw["rope_theta"] = spec.rope_theta
                (path / "config.json").write_text(json.dumps({**raw, **change}))
            built[arch, seed] = str(path)
        return built[arch, seed]

    return get


def _family_engine(
    kind: str, model_dir: str, run_dir: Path, *flags: str
) -> tuple[Engine, Callable[[], None]]:
    python = None
    if kind == "sglang":
        python, missing = find_sglang_python()
        if python is None:
            pytest.skip(f"real SGLang unavailable: {missing}")
    return start_supervised(kind, model_dir, run_dir, sglang_python=python, sglang_args=list(flags))


WEIGHT_SYNC_FAMILIES = [
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "mixtral",
    "minimax_m2",
    "qwen3_5_moe",
    "glm_moe_dsa",
]
# Real SGLang starts in tens of seconds on CPU: a family whose weight-sync case below already
# compares its greedy tokens and log-probs with transformers is not started a second time for it.
# The sparse-attention families' CPU-engine prefill and decode equal transformers' in
# tests/unit/test_cpu_engine_families.py (and GLM-5's after a sync, below); SGLang cannot run them.
UNIT_CHECKED = ("glm_moe_dsa", "deepseek_v32")
GREEDY_CASES = [("cpu", arch) for arch in [*FAMILIES, *FAMILY_VARIANTS] if arch not in UNIT_CHECKED] + [
    pytest.param("sglang", arch, marks=pytest.mark.sglang)
    for arch in [*FAMILIES, *FAMILY_VARIANTS]
    if arch not in WEIGHT_SYNC_FAMILIES and arch not in SGLANG_CPU_CANNOT
]


@pytest.mark.parametrize(("kind", "arch"), GREEDY_CASES)
def test_family_greedy_and_logprobs_equal_transformers(
    kind: str, arch: str, family_models: Callable[..., str], tmp_path: Path
) -> None:
    """Each family's greedy tokens and per-token log-probs equal transformers', one prompt at a
    time and batched (prompts of different lengths in one forward)."""
    if kind == "sglang" and arch in SGLANG_CPU_CANNOT:
        pytest.skip(SGLANG_CPU_CANNOT[arch])
    model_dir = family_models(arch)
    eng, stop = _family_engine(kind, model_dir, tmp_path)
    try:
        assert eng.get("/get_model_info")["model_path"] == model_dir
        for prompt in PROMPTS[:2]:
            assert_matches_hf(greedy(eng, prompt, n=8), model_dir, prompt, TOLERANCE[kind])
        batch = eng.post(
            "/generate",
            {
                "input_ids": PROMPTS,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                "return_logprob": True,
            },
        )
        for out, prompt in zip(batch, PROMPTS, strict=True):
            assert_matches_hf(out, model_dir, prompt, TOLERANCE[kind])
    finally:
        stop()


@pytest.mark.parametrize("arch", WEIGHT_SYNC_FAMILIES)
@pytest.mark.parametrize("kind", ["cpu", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_family_weight_sync_distributed_and_disk(
    kind: str, arch: str, family_models: Callable[..., str], tmp_path: Path
) -> None:
    """The families' Hugging Face names travel every update path: tether's distributed sender
    (flattened buckets) brings another seed's weights, /update_weights_from_disk brings the first
    back; greedy tokens and log-probs follow transformers on each."""
    if kind == "sglang" and arch in SGLANG_CPU_CANNOT:
        pytest.skip(SGLANG_CPU_CANNOT[arch])
    v1, v2 = family_models(arch, 0), family_models(arch, 1)
    new = load_file(str(Path(v2) / "model.safetensors"))
    sync_cfg = WeightSyncConfig(
        update_weight_buffer_size=sum(t.numel() * t.element_size() for t in new.values()) // 3 + 1,
        update_weight_flattened_bucket=True,
        update_weight_request_timeout=120.0,
        update_weight_collective_timeout=120.0,
    )
    eng, stop = _family_engine(kind, v1, tmp_path)

    async def sync() -> LedgerEntry:
        async with engine_client(eng.url, name=kind) as client:
            sender = DistributedTransport([client], sync_cfg, master_port=free_port())
            try:
                return await sender.sync(3, iter(sorted(new.items())))
            finally:
                await sender.close()

    try:
        entry = uvloop.run(sync())
        assert entry.ok and entry.engine_versions == {kind: 3}
        out = greedy(eng, PROMPTS[1], n=8)
        assert out["meta_info"]["weight_version"] == "3"
        assert_matches_hf(out, v2, PROMPTS[1], TOLERANCE[kind])
        body = eng.post("/update_weights_from_disk", {"model_path": v1, "weight_version": "disk-v1"})
        assert body["success"] is True
        assert_matches_hf(greedy(eng, PROMPTS[1], n=8), v1, PROMPTS[1], TOLERANCE[kind])
    finally:
        stop()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("kind", ["cpu", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_routed_experts_equal_transformers_router(
    kind: str, arch: str, family_models: Callable[..., str], tmp_path: Path
) -> None:
    """`return_routed_experts` (engine started with --enable-return-routed-experts, passed the way
    `--sglang-*` flags are): meta_info.routed_experts is base64 int32
    [prompt + completion - 1, layers, top_k], row i the experts transformers' router picks for
    token i (dense layers 0); routed_experts_start_len drops the rows before it."""
    if kind == "sglang":
        pytest.skip(ROUTED_EXPERTS_NO_CPU)
    model_dir = family_models(arch)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers, topk = config["num_hidden_layers"], config["num_experts_per_tok"]
    eng, stop = _family_engine(kind, model_dir, tmp_path, "--enable-return-routed-experts")
    try:
        prompt = PROMPTS[1]
        out = greedy(eng, prompt, n=6, return_routed_experts=True)
        ids = out["output_ids"]
        got = decode_routed_experts(out["meta_info"], layers, topk)
        assert got.shape == (len(prompt) + len(ids) - 1, layers, topk)
        want = hf_routed_experts(model_dir, prompt + ids[:-1])
        # qwen3_moe routes on every layer; deepseek_v3 keeps layer 0 dense.
        assert sorted(want) == (list(range(1, layers)) if arch == "deepseek_v3" else list(range(layers)))
        for layer in range(layers):
            rows = got[:, layer].sort(-1).values
            if layer in want:
                assert torch.equal(rows, want[layer].to(torch.int32)), f"layer {layer}"
            else:
                assert not rows.any(), f"dense layer {layer} reports experts"
        late = greedy(eng, prompt, n=6, return_routed_experts=True, routed_experts_start_len=3)
        assert torch.equal(decode_routed_experts(late["meta_info"], layers, topk), got[3:])
        assert "routed_experts" not in greedy(eng, prompt, n=2)["meta_info"]
        # tether's engine answers a start past the prompt with 400 (SGLang aborts the request),
        # and refuses max_new_tokens 0 (it finishes such a prompt without a forward).
        status, body = eng.request(
            "/generate",
            {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": len(prompt) + 1},
        )
        assert status == 400 and "routed_experts_start_len" in error_message(body)
        status, body = eng.request(
            "/generate",
            {"input_ids": prompt, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 0}},
        )
        assert status == 400 and "max_new_tokens=0" in error_message(body)
    finally:
        stop()


def test_routed_experts_need_the_engine_flag(engine: Engine) -> None:
    """Without --enable-return-routed-experts the CPU engine refuses return_routed_experts by
    name rather than answering without them (SGLang leaves meta_info.routed_experts out)."""
    status, body = engine.request("/generate", {"input_ids": PROMPTS[0], "return_routed_experts": True})
    if engine.kind == "cpu":
        assert status == 400 and "--enable-return-routed-experts" in error_message(body)
    else:
        assert status == 200 and "routed_experts" not in body["meta_info"]

"""The embedded engine's --device/--dtype flags and its memory release/resume bookkeeping, as
SGLang 0.5.23 reads the requests (no tags: every tag of weights, kv_cache, cuda_graph), reported
in /get_server_info; and the colocated decoder's CUDA rules that need no GPU to check. The
engine's HTTP app runs in this process (aiohttp's test server on loopback); no process is started.
The same engine on a GPU is tests/gpu/test_cpu_engine_cuda.py."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from support.cpu_engine_app import host_scheduler
from torch.multiprocessing import reductions

from tether.rollout.cpu_engine.http.common import EngineState
from tether.rollout.cpu_engine.http.sglang_api import make_app
from tether.rollout.cpu_engine.modeling.model import ModelConfigError
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.rollout.cpu_engine.server import _check, add_arguments, engine_device, resolve_dtype
from tether.rollout.engine_api.weights import PayloadRejected, decode_named_tensors
from tether.runtime.errors import ConfigError

ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]
GREEDY = {"input_ids": [5, 17, 3, 99], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model-path", "unused", *argv])


def test_device_and_dtype_default_to_the_cpu_path() -> None:
    args = _parse()
    assert (args.device, args.dtype) == ("cpu", "auto")
    _check(args)
    assert resolve_dtype(args.dtype, args.device, "unused") == torch.float32
    cuda = _parse("--device", "cuda", "--dtype", "bfloat16")
    _check(cuda)
    assert resolve_dtype(cuda.dtype, cuda.device, "unused") == torch.bfloat16


def test_unknown_device_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--device", "gpu")
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "half"])
def test_cpu_device_refuses_reduced_precision(dtype: str) -> None:
    with pytest.raises(ConfigError, match=rf"--dtype='{dtype}': the cpu device computes in float32"):
        _check(_parse("--dtype", dtype))


@pytest.mark.parametrize("dtype", ["float32", "float"])
def test_cpu_device_takes_float32_by_either_name(dtype: str) -> None:
    args = _parse("--dtype", dtype)
    _check(args)
    assert resolve_dtype(args.dtype, args.device, "unused") == torch.float32


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"dtype": "bfloat16"}, torch.bfloat16),  # transformers 5's key
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),  # the key before it
        ({"torch_dtype": "float16"}, torch.float16),
        ({"dtype": "float32"}, torch.float16),  # SGLang: float16 for a float32 checkpoint
        ({}, torch.float16),  # no dtype declared: float32, so float16
    ],
)
def test_auto_dtype_on_cuda_follows_sglang(
    tmp_path: Path, config: dict[str, str], expected: torch.dtype
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", "cuda", str(tmp_path)) == expected
    assert resolve_dtype("float32", "cuda", str(tmp_path)) == torch.float32  # explicit wins


def test_auto_dtype_names_a_config_dtype_it_cannot_serve(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(ModelConfigError, match=r"config.json: dtype='int8'"):
        resolve_dtype("auto", "cuda", str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cuda_device_without_cuda_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--device='cuda': CUDA is not available"):
        engine_device("cuda")
    assert engine_device("cpu") == torch.device("cpu")


# ----- the colocated decoder: CUDA IPC payloads -----


class _CudaEntry:
    """Pickles as torch's CUDA IPC form, the device given as a GPU UUID (tether's sender's)."""

    def __init__(self, device: object) -> None:
        self.device = device

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        args = (torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage, torch.float32, self.device)
        return reductions.rebuild_cuda_tensor, (*args, b"handle", 8, 0, False, b"ref", 0, b"event", False)


def _cuda_payload(device: object) -> str:
    return base64.b64encode(pickle.dumps([("model.norm.weight", _CudaEntry(device))])).decode()


def test_engine_on_the_host_refuses_cuda_payloads() -> None:
    payload = _cuda_payload("GPU-00000000-0000-0000-0000-000000000000")
    for device in (None, torch.device("cpu")):
        with pytest.raises(PayloadRejected, match=r"holds CUDA tensors.*--device cuda"):
            decode_named_tensors(payload, device)


def test_cuda_payload_naming_an_invisible_gpu_is_refused_as_sglang_does() -> None:
    uuid = "GPU-ffffffff-0000-0000-0000-000000000000"  # no GPU has it, here or on a CUDA host
    with pytest.raises(PayloadRejected, match=rf"^Invalid device_uuid={uuid}: no GPU visible"):
        decode_named_tensors(_cuda_payload(uuid), torch.device("cuda", 0))


def test_cuda_payload_with_a_device_of_another_kind_is_refused() -> None:
    with pytest.raises(PayloadRejected, match=r"CUDA device \[0\] is neither an index nor a UUID"):
        decode_named_tensors(_cuda_payload([0]), torch.device("cuda", 0))


# ----- release and resume, through the HTTP app -----


class Engine:
    """An in-process engine app on the host (served without authentication)."""

    def __init__(self, model_dir: str) -> None:
        self.sched = host_scheduler(model_dir, weight_version="disk-v", max_running=4)
        state = EngineState(
            scheduler=self.sched,
            model_path=model_dir,
            host="127.0.0.1",
            port=0,
            disk_path=model_dir,
            disk_version="disk-v",
        )
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(make_app(state)), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())

    def call(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            resp = await self.client.request(method, path, json=payload)
            text = await resp.text()
            return resp.status, json.loads(text) if text else None

        return self.loop.run_until_complete(go())

    def post(self, path: str, payload: Any) -> Any:
        status, body = self.call("POST", path, payload)
        assert status == 200, (path, status, body)
        return body

    def info(self) -> dict[str, Any]:
        status, body = self.call("GET", "/get_server_info")
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = Engine(str(write_tiny_model(tmp_path, TinyModelSpec(seed=2))))
    try:
        yield eng
    finally:
        eng.close()


def _usage(info: dict[str, Any]) -> tuple[int, int]:
    state = info["internal_states"][0]
    return state["weight_bytes"], state["kv_cache_bytes"]


def test_server_info_reports_the_device_and_what_is_held(engine: Engine) -> None:
    before = engine.post("/generate", GREEDY)["output_ids"]
    info = engine.info()
    assert (info["device"], info["dtype"], info["memory_released_tags"]) == ("cpu", "float32", [])
    weights, kv = _usage(info)
    assert weights == sum(t.nbytes for t in engine.sched.model.params.values()) > 0
    assert kv > 0  # the prompt above made the cache grow
    assert info["internal_states"][0]["cuda_memory_allocated"] is None  # no GPU memory on cpu
    assert len(before) == 6


@pytest.mark.parametrize("body", [{}, {"tags": None}, {"tags": []}])
def test_release_without_tags_releases_every_tag_and_resume_brings_them_back(
    engine: Engine, body: dict[str, Any]
) -> None:
    before = engine.post("/generate", GREEDY)["output_ids"]
    engine.post("/update_weight_version", {"new_version": "later"})
    engine.post("/release_memory_occupation", body)
    info = engine.info()
    assert info["memory_released_tags"] == ALL_TAGS
    assert _usage(info) == (0, 0)  # the tensors themselves are gone, not only marked
    status, refused = engine.call("POST", "/generate", GREEDY)
    assert status == 400 and "released" in refused["error"]["message"]
    assert engine.call("GET", "/health")[0] == 503

    engine.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert engine.info()["memory_released_tags"] == ["weights", "cuda_graph"]
    engine.post("/resume_memory_occupation", body)
    info = engine.info()
    assert info["memory_released_tags"] == []
    assert _usage(info)[0] > 0
    assert info["weight_version"] == "disk-v"  # reloaded from the last checkpoint read from disk
    assert engine.post("/generate", GREEDY)["output_ids"] == before


def test_release_of_some_tags_keeps_the_others(engine: Engine) -> None:
    before = engine.post("/generate", GREEDY)["output_ids"]
    engine.post("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    info = engine.info()
    assert info["memory_released_tags"] == ["kv_cache", "cuda_graph"]
    weights, kv = _usage(info)
    assert weights > 0 and kv == 0
    engine.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert engine.info()["memory_released_tags"] == []
    assert engine.post("/generate", GREEDY)["output_ids"] == before


def test_resume_of_a_tag_not_released_changes_nothing(engine: Engine) -> None:
    engine.post("/update_weight_version", {"new_version": "served"})
    engine.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    answer = engine.post("/resume_memory_occupation", {})
    assert answer["success"] is True
    assert (
        answer["message"]
        == "Resumed ['kv_cache']. Not released, left as they were: ['cuda_graph', 'weights']."
    )
    info = engine.info()
    assert info["memory_released_tags"] == [] and info["weight_version"] == "served"  # not reloaded


def test_unknown_memory_tag_is_refused_by_name(engine: Engine) -> None:
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, body = engine.call("POST", path, {"tags": ["weights", "kv"]})
        assert status == 400 and "tags=['kv']: unknown memory tags" in body["error"]["message"]
    assert engine.info()["memory_released_tags"] == []  # nothing was released


def test_cpu_engine_refuses_a_cuda_payload_by_http(engine: Engine) -> None:
    engine.post("/begin_weight_update", {})
    payload = _cuda_payload("GPU-00000000-0000-0000-0000-000000000000")
    status, body = engine.call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert status == 400 and body["success"] is False
    assert "holds CUDA tensors" in body["message"] and "--device cuda" in body["message"]

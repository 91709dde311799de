"""The embedded engine on a GPU (`--device cuda`), as a colocated run uses it; skipped without CUDA.

One engine process serves the tiny model in float32 on the GPU: its greedy tokens equal the
same engine's on the host, a release frees its GPU memory (what /get_server_info reports from
its caching allocator) and a resume brings the same tokens back, and weights sent from this
process as CUDA IPC handles (the colocated transport's payload) are the ones it then serves.
bfloat16 on the GPU runs in this process, against the float32 logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.engines import EngineFactory

from tether.rollout.cpu_engine.modeling.model import KVCache, ModelConfig, TinyLM, read_safetensors_dir
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.rollout.cpu_engine.sampling import SamplingParams, choose_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = [5, 17, 3, 99, 42, 7]
NEW = 8
GREEDY = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
}
MIB = 1 << 20


def _greedy(model: TinyLM, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """What the engine's scheduler runs for one greedy request: a prefill, then a decode per
    token; the tokens and the prompt's last logits."""
    cache = KVCache(model.cfg, model.device, model.dtype)
    slot = cache.allocate(len(prompt) + n + 1)
    greedy = [SamplingParams(temperature=0.0)]
    gen = [torch.Generator()]
    with torch.inference_mode():
        logits = model.prefill([prompt], [slot], cache)
        first = logits.float().cpu()
        out: list[int] = []
        for _ in range(n):
            token = choose_tokens(logits, greedy, gen, False).tokens[0]
            out.append(token)
            logits = model.decode([token], [len(prompt) + len(out) - 1], [slot], cache)
    return out, first


def _host_tokens(model_dir: Path) -> list[int]:
    """The engine's greedy tokens on the host (its default --device cpu, float32)."""
    cfg = ModelConfig.from_dir(model_dir)
    return _greedy(TinyLM(cfg, read_safetensors_dir(model_dir)), PROMPT, NEW)[0]


def _memory(info: dict[str, Any]) -> dict[str, int]:
    state = info["internal_states"][0]
    keys = ("weight_bytes", "kv_cache_bytes", "cuda_memory_allocated", "cuda_memory_reserved")
    return {key: state[key] for key in keys}


def test_engine_on_cuda_generates_releases_resumes_and_takes_ipc_weights(
    tiny_model: Path, tmp_path: Path, cpu_engine: EngineFactory
) -> None:
    engine = cpu_engine("--device", "cuda", "--dtype", "float32")
    info = engine.get("/get_server_info")
    assert (info["device"], info["dtype"], info["memory_released_tags"]) == ("cuda", "float32", [])

    out = engine.post("/generate", GREEDY)
    assert out["output_ids"] == _host_tokens(tiny_model)

    held = _memory(engine.get("/get_server_info"))
    assert held["weight_bytes"] > 0 and held["kv_cache_bytes"] > 0
    assert held["cuda_memory_allocated"] >= held["weight_bytes"] + held["kv_cache_bytes"]
    engine.post("/release_memory_occupation", {})
    info = engine.get("/get_server_info")
    assert info["memory_released_tags"] == ["weights", "kv_cache", "cuda_graph"]
    freed = _memory(info)
    assert freed["weight_bytes"] == freed["kv_cache_bytes"] == 0
    # The weights and the cache left the GPU, and the allocator gave its memory back to the driver.
    assert held["cuda_memory_allocated"] - freed["cuda_memory_allocated"] >= (
        held["weight_bytes"] + held["kv_cache_bytes"]
    )
    assert freed["cuda_memory_allocated"] <= MIB, freed
    assert freed["cuda_memory_reserved"] <= 2 * MIB, freed
    status, refused = engine.request("/generate", GREEDY)
    assert status == 400 and "released" in refused["error"]["message"]

    engine.post("/resume_memory_occupation", {})
    assert engine.get("/get_server_info")["memory_released_tags"] == []
    assert engine.post("/generate", GREEDY)["output_ids"] == out["output_ids"]

    # Colocated: other weights, sent from this process's GPU memory as CUDA IPC handles.
    from tether.rollout.engine_api.weights import serialize_named_tensors, share_named_tensors

    other = write_tiny_model(tmp_path / "v2", TinyModelSpec(seed=1))
    named = [(name, t.cuda()) for name, t in read_safetensors_dir(other).items()]
    shared = share_named_tensors(named)  # kept alive until the engine has answered
    engine.post("/begin_weight_update", {})
    answer = engine.post(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize_named_tensors(shared)], "weight_version": "ipc"},
    )
    engine.post("/end_weight_update", {})
    assert answer["success"] is True, answer
    del shared
    served = engine.post("/generate", GREEDY)
    assert served["meta_info"]["weight_version"] == "ipc"
    assert served["output_ids"] == _host_tokens(other)
    norm = engine.post("/get_weights_by_name", {"name": "model.norm.weight"})
    assert norm == dict(named)["model.norm.weight"].cpu().tolist()


def test_bfloat16_on_cuda_runs_close_to_float32(tiny_model: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_model)
    named = read_safetensors_dir(tiny_model)
    cuda = torch.device("cuda", torch.cuda.current_device())
    bf16 = TinyLM(cfg, named, cuda, torch.bfloat16)
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in bf16.params.values())
    tokens, logits = _greedy(bf16, PROMPT, NEW)
    _, reference = _greedy(TinyLM(cfg, named, cuda, torch.float32), PROMPT, NEW)
    assert len(tokens) == NEW and all(0 <= t < cfg.vocab for t in tokens)
    # bfloat16 keeps 8 bits of mantissa: within a few hundredths of the float32 logits (|x| < 1).
    torch.testing.assert_close(logits, reference, atol=3e-2, rtol=0)

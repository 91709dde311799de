"""Real SGLang on a GPU, through tether's launcher: what the CPU conformance suite cannot run.

- release/resume of a colocated engine (SGLang's memory saver needs CUDA);
- /update_weights_from_tensor with tether's CUDA IPC payload (its GPU named by UUID), then the
  served weights equal what was sent.
Skipped without CUDA or without an SGLang build for it (TETHER_SGLANG_PYTHON / the cached venv).
NCCL to SGLang needs a second GPU: test_cuda_paths' weight group covers tether's side of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.engines import Engine, find_sglang_python, make_models, start_supervised

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str, str]]:
    python, missing = find_sglang_python()
    if python is None:
        pytest.skip(f"real SGLang unavailable: {missing}")
    v1, v2 = make_models(tmp_path_factory.mktemp("models"))
    engine, stop = start_supervised(
        "sglang", v1, tmp_path_factory.mktemp("run"), sglang_python=python,
        sglang_args=["--mem-fraction-static", "0.2"], device_kind="gpu", offload=True,
    )  # fmt: skip
    try:
        yield engine, v1, v2
    finally:
        stop()


def greedy_ids(engine: Engine) -> list[int]:
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    return list(engine.post("/generate", payload)["output_ids"])


def test_release_and_resume_keep_serving(sglang: tuple[Engine, str, str]) -> None:
    engine, _, _ = sglang
    before = greedy_ids(engine)
    engine.post("/release_memory_occupation", {})
    # Weights come back empty under the memory saver: they are loaded again from disk, as tether's
    # head does after a resume (or updated from the trainer).
    engine.post("/resume_memory_occupation", {})
    engine.post("/update_weights_from_disk", {"model_path": sglang[1]})
    assert greedy_ids(engine) == before


def test_cuda_ipc_update_from_tethers_encoder(sglang: tuple[Engine, str, str]) -> None:
    from safetensors.torch import load_file

    from tether.rollout.engine_api.weights import serialize_named_tensors, share_named_tensors

    engine, v1, v2 = sglang
    state = {}
    for f in Path(v2).glob("*.safetensors"):
        state.update(load_file(f))
    named = [(n, t.to("cuda")) for n, t in state.items()]
    shared = share_named_tensors(named)
    engine.post("/begin_weight_update", {})
    body = {"serialized_named_tensors": [serialize_named_tensors(shared)], "flush_cache": True}
    assert engine.post("/update_weights_from_tensor", body)["success"] is True
    engine.post("/end_weight_update", {})
    name = "model.norm.weight"
    got = torch.tensor(engine.post("/get_weights_by_name", {"name": name}))
    assert torch.allclose(got.float(), state[name].float().cpu().reshape(got.shape))
    engine.post("/update_weights_from_disk", {"model_path": v1})

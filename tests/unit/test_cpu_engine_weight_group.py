"""The embedded engine on the host refuses an NCCL weight-update group even where CUDA is
visible (a CPU plan on a CUDA machine): NCCL would be handed host buffers. The engine's HTTP app
runs in this process (aiohttp's test server on loopback); no process is started."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from support.cpu_engine_app import host_scheduler

from tether.rollout.cpu_engine.http.common import EngineLimits, EngineState
from tether.rollout.cpu_engine.http.sglang_api import make_app
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model


def _init_group(model_dir: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], set[str]]:
    """POST /init_weights_update_group to an in-process engine on the host; the status, the
    answer, and the group names the engine has used up."""
    sched = host_scheduler(model_dir)
    # A short rendezvous limit: were the request let through, it would fail fast, not hang.
    state = EngineState(
        scheduler=sched,
        model_path=model_dir,
        host="127.0.0.1",
        port=0,
        limits=EngineLimits(group_setup_timeout=2.0),
    )
    loop = asyncio.new_event_loop()
    client = TestClient(TestServer(make_app(state)), loop=loop)

    async def go() -> tuple[int, dict[str, Any]]:
        await client.start_server()
        try:
            resp = await client.post("/init_weights_update_group", json=body)
            return resp.status, await resp.json()
        finally:
            await client.close()

    try:
        status, answer = loop.run_until_complete(go())
    finally:
        loop.close()
    return status, answer, set(state.used_group_names)


def test_engine_on_the_host_refuses_nccl_even_where_cuda_is_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = str(write_tiny_model(tmp_path, TinyModelSpec(seed=1)))
    # A CUDA host: availability alone must not let NCCL near an engine whose tensors are on the host.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "nccl",
    }
    status, answer, used = _init_group(model_dir, body)
    assert status == 400 and answer["success"] is False
    assert "backend='nccl'" in answer["message"] and "runs on cpu" in answer["message"]
    assert "gloo" in answer["message"]
    assert used == set()  # refused before the group name was taken

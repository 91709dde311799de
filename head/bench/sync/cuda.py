"""`tether bench sync --device cuda`: the colocated sync on one GPU, against a copy of its bytes.

One engine runs on the GPU (`--device cuda`) and takes the trainer's tensors as CUDA IPC handles
through /update_weights_from_tensor, as `tether run --colocate` does. The baseline, measured in the
same run between syncs, is one device-to-device copy of the same bytes: the floor of any handle
sync, which copies at least once on each side. Also timed: the engine releasing and resuming its
memory (what it gives back between phases, as the engine reports it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from tether.bench.engines.launch import cpu_engines
from tether.sync.config import WeightSyncConfig


def copy_seconds(state: dict[str, torch.Tensor]) -> float:
    """One device-to-device copy of every tensor, synchronised: the baseline."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copies = [t.clone() for t in state.values()]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del copies
    return seconds


async def cuda_engine_figures(work: Path, hidden: int, layers: int, syncs: int) -> dict[str, Any]:
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
    from tether.rollout.engine_api.auth import new_engine_key
    from tether.rollout.engine_api.client import EngineClient
    from tether.sync.checkpoint_files import open_checkpoint
    from tether.sync.transports.tensor import TensorTransport

    if not torch.cuda.is_available():
        raise SystemExit("tether bench sync --device cuda: no CUDA device is visible")
    spec = TinyModelSpec(hidden=hidden, layers=layers, heads=8, kv_heads=8, intermediate=4 * hidden)
    model = await asyncio.to_thread(write_tiny_model, work / "model", spec)
    with open_checkpoint(model) as view:
        state = {n: view.tensor(n).to("cuda") for n in view.slots}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    key = new_engine_key()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "engine_model_bytes": nbytes}
    async with cpu_engines(model, key, extra=lambda i: ["--device", "cuda"], log_dir=work) as (url,):
        async with EngineClient(url, name="bench", api_key=key) as client:
            cfg = WeightSyncConfig(update_weight_transport="tensor", update_weight_request_timeout=600.0)  # type: ignore[arg-type]
            transport = TensorTransport([client], cfg)
            times, copies = [], []
            for i in range(syncs):
                entry = await transport.sync(1 + i, iter(state.items()))
                if not entry.ok:
                    raise RuntimeError(f"the tensor sync did not reach the engine: {entry}")
                times.append(entry.total_seconds)
                copies.append(await asyncio.to_thread(copy_seconds, state))
            info_before = await client.get_server_info()
            t0 = time.perf_counter()
            await client.release_memory_occupation()
            out["release_s"] = time.perf_counter() - t0
            info_released = await client.get_server_info()
            t0 = time.perf_counter()
            await client.resume_memory_occupation()
            out["resume_s"] = time.perf_counter() - t0
    out["tensor_first_gb_s"] = nbytes / times[0] / 1e9
    out["tensor_best_gb_s"] = nbytes / min(times) / 1e9
    out["copy_best_gb_s"] = nbytes / min(copies) / 1e9
    # How many device-to-device copies of the weights one sync costs (≥ 2: one on each side).
    out["tensor_sync_over_copy"] = min(times) / min(copies)
    out["engine_memory"] = {
        "resident": {k: v for k, v in info_before.items() if "memory" in k},
        "released": {k: v for k, v in info_released.items() if "memory" in k},
    }
    return out

"""`tether bench sync --json`: delta size and speed, and sync time per transport, on this machine.

Measures, in one run: for a synthetic bf16 checkpoint (--size-gib) with 1%, 10% and 100% of
elements moved by an optimizer-like step, delta bytes over full bytes, encode GB/s and
apply-and-verify GB/s (into a host-local store); then against one CPU engine serving a tiny model
(--engine-hidden/--engine-layers), end-to-end full-disk and delta sync seconds, and distributed
(gloo) sync GB/s next to a raw single-buffer broadcast of the same bytes to a plain receiver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tether.sync.atomic import staged_dir
from tether.sync.checkpoint_files import TORCH_TO_ST, open_checkpoint, tensor_bytes
from tether.sync.config import WeightSyncConfig
from tether.sync.delta import RawTensor, checkpoint_tensors, encode_delta
from tether.sync.hf_writer import write_hf_checkpoint
from tether.sync.local_store import LocalCheckpointStore

TENSOR_ELEMS = 16 * 1024 * 1024  # 32 MiB per bf16 tensor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print one JSON object (the default output).")
    parser.add_argument("--size-gib", type=float, default=1.0, help="Synthetic checkpoint size in GiB.")
    parser.add_argument("--fractions", default="0.01,0.1,1.0", help="Fractions of elements changed.")
    parser.add_argument("--threads", type=int, default=0, help="Delta worker threads (0 = every core).")
    parser.add_argument("--engine-hidden", type=int, default=512, help="Hidden size of the engine's model.")
    parser.add_argument("--engine-layers", type=int, default=8, help="Layers of the engine's model.")
    parser.add_argument("--skip-engine", action="store_true", help="Only the delta format figures.")
    parser.add_argument("--workdir", type=Path, default=None, help="Scratch directory (default: a temp dir).")


def _synthetic(size_gib: float) -> dict[str, torch.Tensor]:
    total = int(size_gib * 1024**3) // 2
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    i = 0
    while total > 0:
        n = min(TENSOR_ELEMS, total)
        state[f"model.layers.{i}.weight"] = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        total -= n
        i += 1
    return state


def _step(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """An optimizer-like step: `frac` of the elements move by a small relative amount."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        x = t.float()
        upd = x * (1e-2 * torch.randn(x.shape, generator=g))
        if frac < 1.0:
            upd *= torch.rand(x.shape, generator=g) < frac
        out[name] = (x + upd).to(t.dtype)
    return out


def _raw(state: dict[str, torch.Tensor]) -> dict[str, RawTensor]:
    return {n: RawTensor(TORCH_TO_ST[t.dtype], list(t.shape), tensor_bytes(t)) for n, t in state.items()}


def delta_figures(
    work: Path, size_gib: float, fractions: list[float], threads: int
) -> list[dict[str, float]]:
    base = _synthetic(size_gib)
    layout = {n: f"model-{i // 8:05d}.safetensors" for i, n in enumerate(base)}
    base_dir = work / "base"
    write_hf_checkpoint(base.items(), base_dir, version=0, layout=layout)
    full = sum(t.numel() * 2 for t in base.values())
    rows = []
    for k, frac in enumerate(fractions):
        new = _step(base, frac, seed=k + 1)
        out = work / f"delta_{k}"
        with open_checkpoint(base_dir) as view, staged_dir(out) as staging:
            t0 = time.perf_counter()
            index = encode_delta(
                checkpoint_tensors(view), _raw(new), staging, version=1, base_version=0, weight_map=layout,
                threads=threads,
            )  # fmt: skip
            encode_s = time.perf_counter() - t0
        del new
        store = LocalCheckpointStore(work / f"store_{k}", threads=threads)
        store.seed(base_dir)
        t0 = time.perf_counter()
        store.apply(out)
        apply_s = time.perf_counter() - t0
        rows.append(
            {
                "changed_fraction": frac,
                "full_bytes": full,
                "delta_bytes": index.delta_bytes,
                "delta_over_full": index.delta_bytes / full,
                "encode_gb_s": full / encode_s / 1e9,
                "apply_verify_gb_s": full / apply_s / 1e9,
            }
        )
        shutil.rmtree(store.root)
        shutil.rmtree(out)
    return rows


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RECEIVER = """
import sys, torch
from datetime import timedelta
from tether.runtime.weight_group import init_weight_group, broadcast
g = init_weight_group(sys.argv[1], 1, 2, "bench-raw", "gloo", timedelta(seconds=300))
buf = torch.empty(int(sys.argv[2]), dtype=torch.uint8)
broadcast(buf, 0, g)
"""


def raw_broadcast_gb_s(nbytes: int) -> float:
    from tether.runtime.weight_group import broadcast, init_weight_group

    method = f"tcp://127.0.0.1:{_port()}"
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, method, str(nbytes)])
    try:
        group = init_weight_group(method, 0, 2, "bench-raw", "gloo", timedelta(seconds=300))
        buf = torch.ones(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        broadcast(buf, 0, group)
        seconds = time.perf_counter() - t0
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return nbytes / seconds / 1e9


async def engine_figures(work: Path, hidden: int, layers: int) -> dict[str, float]:
    from tether.rollout.engine_client import EngineClient
    from tether.rollout.tiny_model import TinyModelSpec, write_tiny_model
    from tether.sync.transport_delta import DeltaDiskTransport
    from tether.sync.transport_disk import FullDiskTransport
    from tether.sync.transport_distributed import DistributedTransport

    spec = TinyModelSpec(hidden=hidden, layers=layers, heads=8, kv_heads=8, intermediate=4 * hidden)
    model = await asyncio.to_thread(write_tiny_model, work / "model", spec)
    with open_checkpoint(model) as view:
        state = {n: view.tensor(n) for n in view.slots}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    port = _port()
    cmd = [sys.executable, "-m", "tether.rollout.cpu_engine", "--model-path", str(model), "--port", str(port)]
    cmd += ["--weight-version", "0"]
    proc = await asyncio.to_thread(
        subprocess.Popen, cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    out: dict[str, float] = {"engine_model_bytes": nbytes}
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", name="bench") as client:
            await client.wait_ready(120)
            base: dict[str, Any] = {
                "update_weight_request_timeout": 600.0,
                "update_weight_disk_dir": str(work / "pub"),
            }
            dist = DistributedTransport([client], WeightSyncConfig(**base), master_port=_port())  # type: ignore[arg-type]
            try:
                await dist.connect()
                entry = await dist.sync(1, iter(state.items()))
                out["distributed_sync_s"] = entry.total_seconds
                out["distributed_gb_s"] = nbytes / entry.total_seconds / 1e9
            finally:
                await dist.close()
            out["raw_broadcast_gb_s"] = await asyncio.to_thread(raw_broadcast_gb_s, nbytes)
            out["distributed_over_raw"] = out["distributed_gb_s"] / out["raw_broadcast_gb_s"]
            disk = FullDiskTransport(
                [client],
                WeightSyncConfig(update_weight_transport="disk", **base),
                base_dir=model,  # type: ignore[arg-type]
            )
            out["disk_sync_s"] = (await disk.sync(2, iter(_step(state, 0.01, 7).items()))).total_seconds
            delta_cfg = WeightSyncConfig(
                update_weight_mode="delta", update_weight_transport="disk",
                update_weight_local_checkpoint_dir=str(work / "local"), **base,  # type: ignore[arg-type]
            )  # fmt: skip
            delta = DeltaDiskTransport([client], delta_cfg, hf_checkpoint=model, base_version=2)
            await asyncio.to_thread(delta.capture_baseline)
            entry = await delta.sync(3, iter(_step(state, 0.01, 8).items()))
            out["delta_sync_s"] = entry.total_seconds
            out["delta_sync_bytes"] = entry.bytes_moved
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def main(args: argparse.Namespace) -> int:
    import uvloop

    fractions = [float(x) for x in args.fractions.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="tether-bench-sync-", dir=args.workdir))
    try:
        result: dict[str, object] = {"size_gib": args.size_gib, "threads": args.threads or None}
        result["delta"] = delta_figures(tmp / "delta", args.size_gib, fractions, args.threads)
        if not args.skip_engine:
            result["engine"] = uvloop.run(
                engine_figures(tmp / "engine", args.engine_hidden, args.engine_layers)
            )
        rows = result["delta"]
        assert isinstance(rows, list)
        one = next((r for r in rows if r["changed_fraction"] == 0.01), None)
        result["targets"] = {
            "delta_1pct_at_most_5pct": None if one is None else one["delta_over_full"] <= 0.05,
            "encode_at_least_1_gb_s": None if one is None else one["encode_gb_s"] >= 1.0,
            "apply_verify_at_least_1_5_gb_s": None if one is None else one["apply_verify_gb_s"] >= 1.5,
        }
        print(json.dumps(result, indent=None if args.json else 2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0

"""The CUDA-only paths of weight sync, against the real torch/NCCL APIs; skipped without CUDA.

- colocated: tensors leave the trainer as CUDA IPC handles naming their GPU by UUID, and
  another process (which may number its GPUs differently) opens them, as SGLang does;
- distributed: NCCL broadcasts take tensors on the sender's GPU (a trainer's export keeps them
  there), and a weight group of two GPUs carries a flattened bucket.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)"
)

# The receiving side of a colocated update, as SGLang's worker does it: map the payload's device
# UUID to this process's device index, open the IPC handles, copy the tensors out.
OPEN_PAYLOAD = textwrap.dedent(
    """
    import base64, pickle, sys, torch
    from torch.multiprocessing import reductions
    original = reductions.rebuild_cuda_tensor
    def by_uuid(*args):
        uuid = args[6]
        assert isinstance(uuid, str), f"device sent as {uuid!r}, not a UUID"
        index = next(i for i in range(torch.cuda.device_count())
                     if str(torch.cuda.get_device_properties(i).uuid) == uuid)
        return original(*args[:6], index, *args[7:])
    reductions.rebuild_cuda_tensor = by_uuid
    reductions.init_reductions()
    named = pickle.loads(base64.b64decode(sys.stdin.read()))
    torch.save({n: t.cpu().clone() for n, t in named}, sys.argv[1])
    """
)


@needs_cuda
def test_cuda_ipc_payload_names_its_gpu_by_uuid_and_opens_in_another_process(tmp_path: Path) -> None:
    from tether.rollout.engine_api.weights import serialize_named_tensors, share_named_tensors

    g = torch.Generator(device="cuda").manual_seed(0)
    named = [
        ("w", torch.randn(64, 32, device="cuda", generator=g, dtype=torch.bfloat16)),
        ("b", torch.randn(32, device="cuda", generator=g)),
    ]
    shared = share_named_tensors(named)
    assert all(t.is_cuda for _, t in shared)
    assert all(s.data_ptr() != t.data_ptr() for (_, s), (_, t) in zip(shared, named, strict=True))
    out = tmp_path / "opened.pt"
    for _ in range(2):  # one entry per engine TP rank, each opened once
        payload = serialize_named_tensors(shared)
        subprocess.run(
            [sys.executable, "-c", OPEN_PAYLOAD, str(out)],
            input=payload,
            text=True,
            check=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        got = torch.load(out)
        for name, t in named:
            assert torch.equal(got[name], t.cpu())
    assert base64.b64decode(payload)  # plain base64 text, as serialized_named_tensors carries


@needs_cuda
def test_distributed_sender_keeps_tensors_on_the_gpu_for_nccl() -> None:
    from tether.sync.transports.distributed import flatten_bucket, wire_device

    device = wire_device("nccl", torch.device("cuda", 0))  # the sender names its GPU
    assert device == torch.device("cuda", 0)
    assert wire_device("gloo") == torch.device("cpu")
    bucket = [("a", torch.ones(3, device=device)), ("b", torch.zeros(2, dtype=torch.bfloat16, device=device))]
    flat = flatten_bucket(bucket)
    assert flat.is_cuda and flat.numel() == 3 * 4 + 2 * 2


RECEIVER = textwrap.dedent(
    """
    import sys, torch
    from tether.runtime.weight_group import init_weight_group, broadcast, destroy_weight_group
    torch.cuda.set_device(1)
    g = init_weight_group(sys.argv[1], 1, 2, "gpu-test", "nccl")
    buf = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda")
    broadcast(buf, 0, g)
    torch.cuda.synchronize()
    torch.save(buf.cpu(), sys.argv[3])
    destroy_weight_group(g)
    """
)


@needs_two
def test_nccl_weight_group_carries_a_flattened_bucket(tmp_path: Path, free_port: int) -> None:
    from tether.runtime.weight_group import broadcast, destroy_weight_group, init_weight_group
    from tether.sync.transports.distributed import flatten_bucket

    port = free_port
    torch.cuda.set_device(0)
    bucket = [
        ("x", torch.arange(10, dtype=torch.float32, device="cuda")),
        ("y", torch.ones(4, device="cuda")),
    ]
    flat = flatten_bucket(bucket)
    out = tmp_path / "received.pt"
    method = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, method, str(flat.numel()), str(out)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        group = init_weight_group(method, 0, 2, "gpu-test", "nccl")
        broadcast(flat, 0, group)
        torch.cuda.synchronize()
        assert proc.wait(timeout=120) == 0
        destroy_weight_group(group)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert torch.equal(torch.load(out), flat.cpu())

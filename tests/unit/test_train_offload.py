"""tether.train.state.offload's storage move, on CPU tensors: views of a moved storage see the same bytes
after the round trip (the mechanism --offload-train uses on CUDA; tests/gpu/test_offload.py runs it
on a GPU with Megatron)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tether.train.state import offload


def test_storage_round_trip_keeps_views_valid() -> None:
    base = torch.arange(12, dtype=torch.float32)
    view = base.view(3, 4)[1:]  # a view, like DDP's param.main_grad into its grad buffer
    other = torch.ones(5, dtype=torch.bfloat16)
    storages = offload.collect_storages([base, view, other, torch.zeros(2, device="meta")], device_type="cpu")
    assert len(storages) == 2  # one storage behind base and its view; the meta tensor is skipped
    state = offload.offload_storages(storages)
    assert state.offloaded and state.nbytes == 12 * 4 + 5 * 2
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    offload.onload_storages(state)
    assert not state.offloaded
    assert view.tolist() == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    assert other.tolist() == [1.0] * 5
    view[0, 0] = 100.0  # still a view of the same storage
    assert base[4].item() == 100.0


def test_offloading_the_trainer_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        offload.offload_trainer(SimpleNamespace(chunks=[], optimizer=None))

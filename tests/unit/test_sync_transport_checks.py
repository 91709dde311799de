"""Weight-sync checks that need no engine: the transport flags' combinations, bucket sizes and
the flattened buckets' alignment, and the engine refusing a misaligned one (the transports
against real engines are tests/integration/test_sync_transports.py)."""

from __future__ import annotations

import pytest
import torch

from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import SyncFailed
from tether.sync.transports.distributed import DistributedTransport


def test_config_rejects_bad_combinations() -> None:
    from tether.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="--update-weight-transport"):
        WeightSyncConfig(update_weight_mode="delta")
    with pytest.raises(ConfigError, match="--update-weight-disk-dir"):
        WeightSyncConfig(update_weight_transport="disk")
    c = WeightSyncConfig(
        update_weight_mode="delta", update_weight_transport="disk", update_weight_disk_dir="/d",
        update_weight_local_checkpoint_dir="/l",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--colocate"):
        c.check_colocate(True)
    with pytest.raises(SyncFailed):
        DistributedTransport([], WeightSyncConfig(), master_port=1, engine_ranks=[0])


def test_buckets_respect_the_size_and_keep_flattened_offsets_aligned() -> None:
    from tether.sync.buckets.grouping import buckets

    named = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),  # 6 bytes: an fp32 after it would sit at 6
        ("b", torch.zeros(2, dtype=torch.float32)),
        ("c", torch.zeros(1, dtype=torch.bool)),
        ("d", torch.zeros(4, dtype=torch.bfloat16)),
        ("e", torch.zeros(100, dtype=torch.float32)),  # larger than a bucket: goes alone
    ]
    plain = [[n for n, _ in b] for b in buckets(named, 32)]
    assert plain == [["a", "b", "c", "d"], ["e"]]
    aligned = [[n for n, _ in b] for b in buckets(named, 32, aligned=True)]
    assert aligned == [["a"], ["b", "c"], ["d"], ["e"]]
    for bucket in buckets(named, 32, aligned=True):
        offset = 0
        for _, t in bucket:
            assert offset % t.element_size() == 0
            offset += t.numel() * t.element_size()


def test_engine_refuses_an_unaligned_flattened_bucket_naming_the_tensor() -> None:
    from tether.rollout.cpu_engine.modeling.model import WeightMismatch
    from tether.rollout.cpu_engine.weights.receive import _check_aligned

    _check_aligned(["x", "y"], [torch.bfloat16, torch.float32], [[4], [2]])  # y at 8: fine
    with pytest.raises(WeightMismatch, match=r"y: byte offset 6 .*float32 element size 4"):
        _check_aligned(["x", "y"], [torch.bfloat16, torch.float32], [[3], [2]])

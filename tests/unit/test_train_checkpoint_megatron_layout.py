"""tether's checkpoints in Megatron-LM's layout on disk: digests in tether/, validation, retention,
and checkpoints of other tools (no digests) loadable only from a directory the user named.

Real `torch.distributed.checkpoint` files written without a process group; no torchrun."""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tether.train.checkpoint import load_save as checkpoint
from tether.train.checkpoint.retention import prune_checkpoints


def _dist_files(d: Path, step: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group: intended here
        dcp.save({"w": torch.arange(4096, dtype=torch.float32) * step}, checkpoint_id=str(d), no_dist=True)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"iteration": step}, d / "common.pt")


def write_new(root: Path, step: int) -> Path:
    """iter_N as `checkpoint.save` leaves it: torch_dist files at the top, tether/ beside them."""
    d = root / checkpoint.iter_dir_name(step)
    _dist_files(d, step)
    (d / "tether" / "rng").mkdir(parents=True)
    rng = checkpoint.RngState(
        python=[3, [1, 2], None],
        numpy_state=("MT19937", b"\0" * 8, 0, 0, 0.0),
        torch_cpu=b"",
        torch_cuda=None,
        tracker={},
    )
    (d / "tether" / "rng" / "rank_00000.msgpack").write_bytes(msgspec.msgpack.encode(rng))
    state = checkpoint.RunState(step=step, rollout_id=step, weight_version=step + 1)
    (d / "tether" / "run_state.msgpack").write_bytes(msgspec.msgpack.encode(state))
    checkpoint.write_digests(d)
    (root / checkpoint.TRACKER).write_text(str(step))
    return d


def test_digests_live_in_tether_and_cover_the_megatron_files(tmp_path: Path) -> None:
    d = write_new(tmp_path, 2)
    record = msgspec.msgpack.decode(
        (d / "tether" / "digests.msgpack").read_bytes(), type=checkpoint.CheckpointDigests
    )
    assert {".metadata", "common.pt", "metadata.json", "tether/run_state.msgpack"} <= set(record.files)
    assert "tether/digests.msgpack" not in record.files
    checkpoint.validate_checkpoint(d)


def test_a_flipped_bit_in_the_new_layout_falls_back_to_the_previous(tmp_path: Path) -> None:
    write_new(tmp_path, 1)
    newest = write_new(tmp_path, 2)
    shard = next(newest.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    path, skipped = checkpoint.select_checkpoint(tmp_path)
    assert path == tmp_path / "iter_0000001"
    assert [s.path for s in skipped] == [str(newest)] and "xxh3-128" in skipped[0].error


def test_another_tools_checkpoint_loads_only_when_named(tmp_path: Path) -> None:
    root = tmp_path / "slime_ckpt"
    _dist_files(root / "release", 0)
    (root / checkpoint.TRACKER).write_text("release")
    path, skipped = checkpoint.select_checkpoint(root)
    assert path is None and "--load or --ref-load" in skipped[0].error
    assert checkpoint.select_checkpoint(root, named=True) == (root / "release", [])
    # Trusted but checked: a truncated shard is refused even when named.
    shard = next((root / "release").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    path, skipped = checkpoint.select_checkpoint(root, named=True)
    assert path is None and "truncated" in skipped[0].error


def test_retention_prunes_the_new_layout(tmp_path: Path) -> None:
    for step in (1, 3, 5, 7):
        write_new(tmp_path, step)
    deleted = prune_checkpoints(tmp_path, keep_last=2, keep_every=None)
    assert [d.step for d in deleted] == [1, 3]
    assert checkpoint.complete_checkpoints(tmp_path) == [5, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", "iter_0000007", checkpoint.TRACKER]


def test_retention_never_touches_another_tools_checkpoint(tmp_path: Path) -> None:
    for step in (1, 3):
        write_new(tmp_path, step)
    _dist_files(tmp_path / "release", 0)
    (tmp_path / checkpoint.TRACKER).write_text("release")
    # release/ has no digests, so it anchors nothing; tether's own are pruned past it.
    assert [d.step for d in prune_checkpoints(tmp_path, keep_last=1, keep_every=None)] == [1]
    assert (
        checkpoint.complete_checkpoints(tmp_path) == [3]
        and (tmp_path / "release" / "metadata.json").is_file()
    )


@pytest.mark.parametrize("text", ["release", "x"])
def test_damaged_trackers_do_not_break_the_scan(tmp_path: Path, text: str) -> None:
    write_new(tmp_path, 4)
    (tmp_path / checkpoint.TRACKER).write_text(text)
    # "release" names a missing release/; "x" is unreadable: the newest complete one is used.
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000004"

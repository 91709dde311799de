"""Choosing the checkpoint to resume from when the newest complete one is damaged.

Real `torch.distributed.checkpoint` files (written here without a process group) in the
layout `train/checkpoint/load_save.py` saves; the selection itself needs no torchrun.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tether.train.checkpoint import load_save as checkpoint


def _write(root: Path, step: int, *, digests: bool = True) -> Path:
    """A checkpoint directory with real shard files and every file a load reads; with `digests`
    as `checkpoint.save` leaves it, without as an older tether or another tool would."""
    d = root / checkpoint.iter_dir_name(step)
    model = d / checkpoint.MODEL_OPTIM
    with warnings.catch_warnings():
        # DCP notes that it runs without a process group; that is what this test wants.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"w": torch.arange(4096, dtype=torch.float32) * step}, checkpoint_id=str(model), no_dist=True
        )
    (model / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"step": step}, model / "common.pt")
    (d / "rng").mkdir()
    rng = checkpoint.RngState(
        python=[3, [1, 2], None],
        numpy_state=("MT19937", b"\0" * 8, 0, 0, 0.0),
        torch_cpu=b"",
        torch_cuda=None,
        tracker={},
    )
    (d / "rng" / "rank_00000.msgpack").write_bytes(msgspec.msgpack.encode(rng))
    state = checkpoint.RunState(step=step, rollout_id=step, weight_version=step + 1)
    (d / checkpoint.RUN_STATE).write_bytes(msgspec.msgpack.encode(state))
    if digests:
        checkpoint.write_digests(d)
    (root / checkpoint.LATEST).write_text(str(step))
    return d


def _shard(d: Path) -> Path:
    shards = sorted((d / checkpoint.MODEL_OPTIM).glob("*.distcp"))
    assert shards
    return shards[0]


def test_whole_checkpoints_validate_and_the_newest_is_chosen(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint.validate_checkpoint(_write(tmp_path, step))
    assert checkpoint.select_checkpoint(tmp_path) == (tmp_path / "iter_0000003", [])
    assert checkpoint.checkpoint_candidates(tmp_path) == [tmp_path / f"iter_000000{i}" for i in (3, 2, 1)]


def test_truncated_shard_falls_back_to_the_previous_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    newest = _write(tmp_path, 3)
    shard = _shard(newest)
    shard.write_bytes(shard.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        path, skipped = checkpoint.select_checkpoint(tmp_path)
    assert path == tmp_path / "iter_0000002"
    assert [s.path for s in skipped] == [str(newest)]
    assert str(shard) in skipped[0].error and "truncated" in skipped[0].error
    assert str(newest) in caplog.text
    # A checkpoint the caller already found unloadable is not offered again.
    assert checkpoint.select_checkpoint(tmp_path, exclude={str(tmp_path / "iter_0000002")})[0] == (
        tmp_path / "iter_0000001"
    )


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "named-without-digests"])
@pytest.mark.parametrize("damage", ["run_state", "metadata", "common", "rng", "missing_shard"])
def test_each_damaged_file_is_named(tmp_path: Path, damage: str, digests: bool) -> None:
    # Without digests the checks are the trusted-input ones, for a directory the user named.
    _write(tmp_path, 1, digests=digests)
    d = _write(tmp_path, 2, digests=digests)
    model = d / checkpoint.MODEL_OPTIM
    target = {
        "run_state": d / checkpoint.RUN_STATE,
        "metadata": model / ".metadata",
        "common": model / "common.pt",
        "rng": d / "rng" / "rank_00000.msgpack",
        "missing_shard": _shard(d),
    }[damage]
    if damage == "missing_shard":
        target.unlink()
    elif damage == "common":
        with zipfile.ZipFile(target) as z:  # flip a byte inside a member: the CRC check fails
            info = next(i for i in z.infolist() if i.file_size > 0)
        raw = bytearray(target.read_bytes())
        header = info.header_offset  # the local header's name and extra lengths sit at 26 and 28
        start = header + 30 + int.from_bytes(raw[header + 26 : header + 28], "little")
        start += int.from_bytes(raw[header + 28 : header + 30], "little")
        raw[start] ^= 0xFF
        target.write_bytes(bytes(raw))
    else:
        target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 3)])
    with pytest.raises(ValueError, match=str(target).replace(".", r"\.")):
        checkpoint.validate_checkpoint(d, named=not digests)
    path, skipped = checkpoint.select_checkpoint(tmp_path, named=not digests)
    assert path == tmp_path / "iter_0000001" and skipped[0].path == str(d)


def test_only_damaged_checkpoints_leave_nothing_to_load(tmp_path: Path) -> None:
    d = _write(tmp_path, 1)
    (d / checkpoint.RUN_STATE).write_bytes(b"\xc1")
    path, skipped = checkpoint.select_checkpoint(tmp_path)
    assert path is None and len(skipped) == 1


def test_a_checkpoint_that_fails_to_load_is_skipped_for_the_next(tmp_path: Path) -> None:
    """The loop `--load` and `--ref-load` share: a checkpoint whose files validate but whose
    load raises is skipped (with its error) for the next newest."""
    for step in (1, 2, 3):
        _write(tmp_path, step)
    tried: list[Path] = []

    def load_one(path: Path) -> int:
        tried.append(path)
        if path.name == "iter_0000003":
            raise KeyError("model.layers.0 missing")
        return int(path.name.removeprefix("iter_"))

    got = checkpoint._load_first_loadable(tmp_path, "--ref-load", load_one)
    assert got is not None
    step, path, skipped = got
    assert (step, path) == (2, str(tmp_path / "iter_0000002"))
    assert tried == [tmp_path / "iter_0000003", tmp_path / "iter_0000002"]
    assert [s.path for s in skipped] == [str(tmp_path / "iter_0000003")]
    assert "KeyError" in skipped[0].error and "model.layers.0 missing" in skipped[0].error


def test_ref_load_names_its_flag_when_nothing_loads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--ref-load=.*no complete checkpoint"):
        checkpoint.load_weights_only([], tmp_path)
    only = _write(tmp_path, 1)
    shard = _shard(only)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        RuntimeError,
        match=r"--ref-load=.*every complete checkpoint is damaged or cannot load here.*truncated",
    ):
        checkpoint.load_weights_only([], tmp_path)

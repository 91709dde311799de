"""Delta apply builds each version aside at the cost of what changed: unchanged shards are the
previous version's files (reflink or hard link), changed ones new read-only files; crashes at any
point leave the previous version whole."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import xxhash

import tether.sync.delta as delta_mod
from tether.runtime.files.atomic_file import staged_dir
from tether.sync.checkpoint_files import open_checkpoint, read_marker, verify_checkpoint
from tether.sync.delta import ChecksumMismatch, WrongBase, diff_checkpoints, reuse_file
from tether.sync.delta_format import DELTA_INDEX, read_index
from tether.sync.hf_writer import write_hf_checkpoint
from tether.sync.local_store import LocalCheckpointStore

NAMES = ["embed.weight", "layers.0.up.weight", "layers.1.up.weight", "norm.weight", "final_norm.weight"]
# The norms never change and have a shard of their own: it is the one a delta leaves alone.
LAYOUT = {n: "b.safetensors" if "norm" in n else f"a{i % 2}.safetensors" for i, n in enumerate(NAMES)}


class Crash(BaseException):
    """Stands for the process dying where it is raised."""


def states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    first = {name: torch.randn(64, 32, generator=g).to(torch.bfloat16) for name in NAMES}
    out = [first]
    for v in range(1, n):
        nxt = {}
        for name, t in out[-1].items():
            if "norm" in name:
                nxt[name] = t.clone()
            else:
                mask = torch.rand(t.shape, generator=g) < 0.1
                nxt[name] = (t.float() + 0.01 * v * torch.randn(t.shape, generator=g) * mask).to(t.dtype)
        out.append(nxt)
    return out


@pytest.fixture
def chain(tmp_path: Path) -> list[tuple[dict[str, torch.Tensor], Path]]:
    out = []
    for v, state in enumerate(states(3)):
        path = tmp_path / f"full_v{v}"
        write_hf_checkpoint(state.items(), path, version=v, layout=LAYOUT)
        out.append((state, path))
    return out


def make_delta(base: Path, new: Path, out: Path) -> Path:
    with staged_dir(out) as staging:
        diff_checkpoints(
            base,
            new,
            staging,
            base_version=read_marker(base).version,  # type: ignore[union-attr]
            version=read_marker(new).version,  # type: ignore[union-attr]
        )
    return out


def tensors_of(ckpt: Path) -> dict[str, bytes]:
    with open_checkpoint(ckpt) as view:
        return {name: view.bytes_of(name).tobytes() for name in view.slots}


def expected(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in state.items()}


def files_of(ckpt: Path) -> dict[str, tuple[int, str]]:
    """Every file of a version: inode and a digest of its bytes."""
    return {p.name: (p.stat().st_ino, xxhash.xxh3_64_hexdigest(p.read_bytes())) for p in ckpt.iterdir()}


def writable(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o222)


def test_unchanged_shards_are_the_previous_files_and_changed_ones_new_read_only_files(
    tmp_path: Path, chain: list
) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    v0 = store.root / "weight_v000000"
    assert not any(writable(p) for p in v0.glob("*.safetensors"))  # the seed's copies too
    store.apply(make_delta(chain[0][1], chain[1][1], tmp_path / "d1"))
    v1 = store.root / "weight_v000001"
    ino = lambda ckpt, name: (ckpt / name).stat().st_ino  # noqa: E731
    # Same inode: a hard link (ext4, tmpfs) — on a reflink filesystem a clone, its own inode.
    reflinks = ino(v1, "b.safetensors") != ino(v0, "b.safetensors")
    if not reflinks:
        assert (v1 / "b.safetensors").stat().st_nlink == 2
        assert ino(v1, "model.safetensors.index.json") == ino(v0, "model.safetensors.index.json")
    for changed in ("a0.safetensors", "a1.safetensors"):
        assert ino(v1, changed) != ino(v0, changed)
        assert (v1 / changed).stat().st_nlink == 1
    # No file of either version can be opened for writing by an ordinary user: a shared inode is
    # only ever replaced by the next version's new file, never written through.
    for path in [*v0.glob("*.safetensors"), *v1.glob("*.safetensors")]:
        assert not writable(path), path
    held_v1 = files_of(v1)
    store.apply(make_delta(chain[1][1], chain[2][1], tmp_path / "d2"))
    store.wait_pruned()
    v2 = store.root / "weight_v000002"
    assert files_of(v1) == held_v1  # the previous version, byte for byte and inode for inode
    if not reflinks:
        assert ino(v2, "b.safetensors") == ino(v1, "b.safetensors")
    assert tensors_of(v2) == expected(chain[2][0])
    verify_checkpoint(v1)
    verify_checkpoint(v2)
    assert not v0.exists()


def test_where_reflinks_exist_only_the_frames_are_written(
    tmp_path: Path, chain: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_clone(src: Path, dst: Path) -> int:
        # A reflink as far as the apply can tell: a new inode already holding src's bytes.
        fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, src.read_bytes())
        return fd

    written: list[int] = []
    real_pwrite = delta_mod._pwrite_all

    def counting_pwrite(fd: int, data: np.ndarray, offset: int) -> None:
        written.append(data.nbytes)
        real_pwrite(fd, data, offset)

    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    monkeypatch.setattr(delta_mod, "clone_file", fake_clone)
    monkeypatch.setattr(delta_mod, "_pwrite_all", counting_pwrite)
    store.apply(delta)
    index = read_index(delta)
    frame_bytes = sum(fr.count * 2 for t in index.tensors.values() for fr in t.frames)  # bf16
    changed_files = sum((chain[1][1] / s).stat().st_size for s in ("a0.safetensors", "a1.safetensors"))
    assert sum(written) == frame_bytes < changed_files  # no base bytes copied around the frames
    v0, v1 = store.root / "weight_v000000", store.root / "weight_v000001"
    assert (v1 / "b.safetensors").stat().st_ino != (v0 / "b.safetensors").stat().st_ino  # a clone
    assert tensors_of(v1) == expected(chain[1][0])
    verify_checkpoint(v1)
    assert not any(writable(p) for p in v1.glob("*.safetensors"))


def test_a_refused_reflink_is_remembered_and_falls_back_to_a_hard_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def no_reflink(fd: int, request: int, arg: int) -> int:
        calls.append(request)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(delta_mod, "_no_reflink", set())
    monkeypatch.setattr(delta_mod.fcntl, "ioctl", no_reflink)
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "out").mkdir()
    for name in ("x.safetensors", "y.safetensors"):
        (src / name).write_bytes(name.encode() * 100)
        assert reuse_file(src / name, tmp_path / "out" / name) == "link"
        assert (tmp_path / "out" / name).stat().st_ino == (src / name).stat().st_ino
        assert not writable(tmp_path / "out" / name)
    assert calls == [delta_mod.FICLONE]  # asked once per pair of filesystems
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.safetensors", "y.safetensors"]


def test_a_crash_mid_apply_leaves_the_previous_version_whole(
    tmp_path: Path, chain: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalCheckpointStore(tmp_path / "store", threads=2)
    store.seed(chain[0][1])
    v0 = store.root / "weight_v000000"
    held = files_of(v0)
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    leftover = store.root / "weight_v000001.tmp-99999"
    real_write = delta_mod._ShardWriter.write
    pieces: list[int] = []

    def dying_write(self: delta_mod._ShardWriter, piece: delta_mod._Write) -> None:
        real_write(self, piece)
        pieces.append(piece.offset)
        if len(pieces) == 2:
            # What a killed process leaves: its half-built staging directory, hard links included.
            if not leftover.exists():
                leftover.mkdir()
                for p in self.out_dir.iterdir():
                    os.link(p, leftover / p.name)
            raise Crash

    monkeypatch.setattr(delta_mod._ShardWriter, "write", dying_write)
    with pytest.raises(Crash):
        store.apply(delta)
    monkeypatch.undo()
    assert store.version() == 0 and store.current_path() == v0.resolve()
    assert files_of(v0) == held  # not one byte of the previous version moved
    verify_checkpoint(v0)
    assert not (store.root / "weight_v000001").exists()  # the new version: absent, not partial
    assert any(leftover.iterdir())
    # The next applier clears the leftovers (removing names only: v0's files stay) and succeeds.
    assert LocalCheckpointStore(store.root).apply(delta).version == 1
    assert not leftover.exists()
    assert files_of(v0) == held
    assert tensors_of(store.root / "weight_v000001") == expected(chain[1][0])


def test_a_crash_while_pruning_leaves_the_new_version_complete(
    tmp_path: Path, chain: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalCheckpointStore(tmp_path / "store", keep_previous=0)
    store.seed(chain[0][1])

    def dying_remove(self: LocalCheckpointStore, dropped: list[Path]) -> None:
        raise Crash

    monkeypatch.setattr(LocalCheckpointStore, "_remove", dying_remove)
    assert store.apply(make_delta(chain[0][1], chain[1][1], tmp_path / "d1")).version == 1
    with pytest.raises(Crash):
        store.close()
    monkeypatch.undo()
    assert store.version() == 1
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]
    assert [p.name.split(".old-")[0] for p in store.root.iterdir() if ".old-" in p.name] == [
        "weight_v000000"
    ]  # renamed aside: no longer a version, its removal cut short
    with LocalCheckpointStore(store.root, keep_previous=0) as other:
        other.apply(make_delta(chain[1][1], chain[2][1], tmp_path / "d2"))
    assert sorted(p.name for p in store.root.iterdir() if not p.name.startswith(".")) == [
        "current",
        "weight_v000002",
    ]
    assert tensors_of(store.root / "weight_v000002") == expected(chain[2][0])


def test_base_bytes_damaged_under_an_intact_marker_are_refused_as_wrong_base(
    tmp_path: Path, chain: list
) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    v0 = store.root / "weight_v000000"
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    name = read_index(delta).changed()[0]
    with open_checkpoint(v0) as view:
        at = view.slots[name].start + 3
    shard = v0 / LAYOUT[name]
    shard.chmod(0o644)  # bit rot does not ask: flip one bit of a changed tensor's base bytes
    raw = bytearray(shard.read_bytes())
    raw[at] ^= 0x01
    shard.write_bytes(bytes(raw))
    held = files_of(v0)
    with pytest.raises(WrongBase, match="base checksum"):
        store.apply(delta)
    assert store.version() == 0 and files_of(v0) == held
    assert not [p for p in store.root.iterdir() if ".tmp-" in p.name]


def test_an_unchanged_tensor_recorded_with_another_result_is_refused(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    index = read_index(delta)
    index.tensors["norm.weight"].checksum = "0" * len(index.tensors["norm.weight"].checksum)
    (delta / DELTA_INDEX).write_bytes(msgspec.json.encode(index))
    with pytest.raises(ChecksumMismatch, match=r"norm\.weight"):
        store.apply(delta)
    assert store.version() == 0
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]

"""Delta-disk format: diff/apply/verify on real files, and every refusal leaves the store untouched."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tether.runtime.files.atomic_file import staged_dir
from tether.sync.checkpoint_files import open_checkpoint, read_marker, verify_checkpoint
from tether.sync.delta import (
    ChecksumMismatch,
    CorruptDelta,
    DeltaRefused,
    VersionGap,
    WrongBase,
    apply_delta,
    diff_checkpoints,
    verify_delta,
)
from tether.sync.delta_format import DELTA_INDEX, delta_dir_name, read_index
from tether.sync.hf_writer import write_hf_checkpoint
from tether.sync.local_store import LocalCheckpointStore


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.randn(64, 32, generator=g).to(torch.float16),
    }


def step(state: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """An optimizer-like step: a fraction of the elements of the float tensors move a little."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if "norm" in name:
            out[name] = t.clone()  # unchanged tensors must be skipped
            continue
        mask = torch.rand(t.shape, generator=g) < frac
        noise = torch.randn(t.shape, generator=g) * 0.01
        out[name] = (t.float() + noise * mask).to(t.dtype)
    return out


def write(state: dict[str, torch.Tensor], path: Path, version: int) -> Path:
    write_hf_checkpoint(state.items(), path, version=version, max_shard_bytes=6000)
    return path


def make_delta(base: Path, new: Path, out: Path, *, encoding: str = "xor") -> Path:
    with staged_dir(out) as staging:
        diff_checkpoints(
            base,
            new,
            staging,
            base_version=read_marker(base).version,  # type: ignore[union-attr]
            version=read_marker(new).version,  # type: ignore[union-attr]
            encoding=encoding,
        )
    return out


def tensors_of(ckpt: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(ckpt) as view:
        return {name: view.tensor(name) for name in view.slots}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].reshape(a[name].shape).view(torch.uint8)), name


@pytest.fixture
def chain(tmp_path: Path) -> list[tuple[dict[str, torch.Tensor], Path]]:
    states = [make_state()]
    for v in range(1, 4):
        states.append(step(states[-1], 0.05 * v, seed=v))
    return [(s, write(s, tmp_path / f"full_v{v}", v)) for v, s in enumerate(states)]


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_delta_chain_applies_over_several_versions(tmp_path: Path, chain: list, encoding: str) -> None:
    store = LocalCheckpointStore(tmp_path / "store", threads=2)
    store.seed(chain[0][1])
    assert store.version() == 0
    for v in range(1, len(chain)):
        delta = make_delta(chain[v - 1][1], chain[v][1], tmp_path / delta_dir_name(v), encoding=encoding)
        index = verify_delta(delta)
        assert index.version == v and index.base_version == v - 1 and index.encoding == encoding
        assert "model.norm.weight" not in index.changed()  # unchanged tensors are skipped
        assert index.delta_bytes < index.full_bytes
        out = store.apply(delta)
        assert out.changed and out.version == v
        assert_same(tensors_of(store.current_path()), chain[v][0])  # type: ignore[arg-type]
        store.verify()
    # old versions are pruned (their files removed by the store's pruner, off the apply's
    # path): only current and the previous one remain
    store.wait_pruned()
    assert sorted(p.name for p in store.root.iterdir() if p.name.startswith("weight_v")) == [
        "weight_v000002",
        "weight_v000003",
    ]


def test_duplicate_apply_changes_nothing(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    assert store.apply(delta).changed
    again = store.apply(delta)  # a second XOR would revert the update
    assert not again.changed and again.version == 1
    assert_same(tensors_of(store.current_path()), chain[1][0])  # type: ignore[arg-type]


def test_wrong_base_and_gap_are_refused_untouched(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    before = store.current_path()
    d2 = make_delta(chain[1][1], chain[2][1], tmp_path / "d2")
    with pytest.raises(VersionGap, match="missing"):
        store.apply(d2)
    assert store.version() == 0 and store.current_path() == before
    # A base at the right version number but with other bytes: the base checksums catch it.
    other = write(step(chain[0][0], 0.5, seed=99), tmp_path / "other_v0", 0)
    store2 = LocalCheckpointStore(tmp_path / "store2")
    store2.seed(other)
    d1 = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    with pytest.raises(WrongBase, match="base checksum"):
        store2.apply(d1)
    assert store2.version() == 0
    verify_checkpoint(store2.current_path())  # type: ignore[arg-type]
    assert not [p for p in store2.root.iterdir() if ".tmp-" in p.name]


def test_corrupted_byte_and_truncated_file_are_refused(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    data = delta / "delta-00000.bin"
    good = data.read_bytes()
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0x40
    data.write_bytes(bytes(corrupt))
    with pytest.raises(CorruptDelta, match="digest"):
        store.apply(delta)
    data.write_bytes(good[: len(good) - 7])
    with pytest.raises(CorruptDelta, match="truncated"):
        store.apply(delta)
    assert store.version() == 0
    data.write_bytes(good)
    assert store.apply(delta).version == 1


def test_checksum_mismatch_after_apply_is_refused(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    # A consistent-looking delta whose recorded result checksum is wrong (a bad publisher).
    text = (delta / DELTA_INDEX).read_text()
    index = read_index(delta)
    name = index.changed()[0]
    text = text.replace(index.tensors[name].checksum, "0" * len(index.tensors[name].checksum))
    (delta / DELTA_INDEX).write_text(text)
    with pytest.raises(ChecksumMismatch):
        store.apply(delta)
    assert store.version() == 0
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]


def test_crash_between_write_and_rename_keeps_old_version(
    tmp_path: Path, chain: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tether.sync.local_store as local_store

    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")

    class Crash(BaseException):
        pass

    def crash(staging: Path, final: Path) -> None:
        assert any(staging.iterdir())  # the new files were fully written beside the old ones
        raise Crash

    monkeypatch.setattr(local_store, "publish_dir", crash)
    with pytest.raises(Crash):
        store.apply(delta)
    monkeypatch.undo()
    assert store.version() == 0
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]
    # A real crash leaves the staging dir behind; the next applier clears it and succeeds.
    (store.root / "weight_v000001.tmp-99999").mkdir()
    assert store.apply(delta).version == 1
    assert not [p for p in store.root.iterdir() if ".tmp-" in p.name]


def test_two_appliers_racing_apply_once(tmp_path: Path, chain: list) -> None:
    root = tmp_path / "store"
    LocalCheckpointStore(root).seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    outcomes: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        try:
            barrier.wait()
            outcomes.append(LocalCheckpointStore(root).apply(delta).changed)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(outcomes) == [False, True]
    assert_same(tensors_of(LocalCheckpointStore(root).current_path()), chain[1][0])  # type: ignore[arg-type]


def test_repair_from_full_version_after_broken_chain(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    d3 = make_delta(chain[2][1], chain[3][1], tmp_path / "d3")
    with pytest.raises(DeltaRefused):
        store.apply(d3)
    assert store.repair(chain[2][1]).version == 2
    assert store.apply(d3).version == 3
    assert_same(tensors_of(store.current_path()), chain[3][0])  # type: ignore[arg-type]


def test_xor_delta_of_one_percent_change_is_small(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(4)}
    new = step(base, 0.01, seed=1)
    b, n = write(base, tmp_path / "b", 0), write(new, tmp_path / "n", 1)
    index = read_index(make_delta(b, n, tmp_path / "d"))
    assert index.delta_bytes / index.full_bytes < 0.05
    assert os.path.getsize(tmp_path / "d" / "delta-00000.bin") == index.delta_bytes
    assert np.isclose(index.full_bytes, 4 * 256 * 256 * 2)
    shutil.rmtree(tmp_path / "d")


def test_chain_writes_new_files_and_prunes_only_after_publishing(tmp_path: Path, chain: list) -> None:
    # Unchanged tensors get their own shard, so v1 hard-links it from v0.
    layout = {
        n: "b.safetensors" if "norm" in n else f"a{i % 2}.safetensors" for i, n in enumerate(chain[0][0])
    }
    full = []
    for v, (state, _) in enumerate(chain[:3]):
        write_hf_checkpoint(state.items(), tmp_path / f"lay_v{v}", version=v, layout=layout)
        full.append(tmp_path / f"lay_v{v}")
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(full[0])
    store.apply(make_delta(full[0], full[1], tmp_path / "d1"))
    v0, v1 = store.root / "weight_v000000", store.root / "weight_v000001"
    inodes_v0 = {p.name: p.stat().st_ino for p in v0.glob("*.safetensors")}
    shared = {p.name for p in v1.glob("*.safetensors") if p.stat().st_nlink > 1}  # hard links to v0
    assert shared and set(inodes_v0) - shared  # the fixture has both kinds of shard
    with pytest.raises(WrongBase):  # a refused apply takes nothing from the version it would prune
        store.apply(make_delta(full[0], full[2], tmp_path / "d02"))
    verify_checkpoint(v0)
    store.apply(make_delta(full[1], full[2], tmp_path / "d2"))
    v2 = store.root / "weight_v000002"
    # v2's changed shards are new files (no version's files are written over: a late refusal
    # must leave them whole); only the unchanged shard is still the one hard link.
    kept = {n for n in inodes_v0 if (v2 / n).stat().st_ino == inodes_v0[n]}
    assert kept == shared
    assert_same(tensors_of(v2), chain[2][0])
    verify_checkpoint(v1)  # the kept previous version (sharing files with v0) is intact
    assert not v0.exists()  # no longer a version the moment v2 is published
    store.wait_pruned()
    assert not [p for p in store.root.iterdir() if ".old-" in p.name]


def test_frame_outside_its_tensor_is_refused(tmp_path: Path, chain: list) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0][1])
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    index = read_index(delta)
    name = index.changed()[0]
    frame = index.tensors[name].frames[0]
    index.tensors[name].frames[0] = msgspec.structs.replace(frame, start=frame.start + frame.count + 1)
    (delta / DELTA_INDEX).write_bytes(msgspec.json.encode(index))
    with pytest.raises(CorruptDelta, match="past the tensor's end"):
        store.apply(delta)
    assert store.version() == 0
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]


def test_apply_stops_every_writer_on_a_bad_frame(tmp_path: Path, chain: list) -> None:
    # apply_delta on its own (the store checks frame digests first): a frame failing inside the
    # thread pool aborts the whole apply with a clear error; the base is only ever read.
    delta = make_delta(chain[0][1], chain[1][1], tmp_path / "d1")
    data = delta / "delta-00000.bin"
    corrupt = bytearray(data.read_bytes())
    corrupt[-3] ^= 0x10
    data.write_bytes(bytes(corrupt))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptDelta, match="digest"):
        apply_delta(chain[0][1], 0, delta, out, threads=2)
    verify_checkpoint(chain[0][1])


def test_new_shard_files_are_preallocated_or_at_least_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An apply's output file gets all its blocks before the pieces are written (writing into a
    sparse file allocates at every write, several times slower); where the filesystem cannot
    preallocate, the file is still sized."""
    from tether.sync.delta import preallocate

    size = 3 * 1024**2 + 5
    fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        preallocate(fd, size)
        st = os.fstat(fd)
        assert st.st_size == size and st.st_blocks * 512 >= size
        empty = os.open(tmp_path / "empty", os.O_WRONLY | os.O_CREAT)
        preallocate(empty, 0)
        os.close(empty)
        assert (tmp_path / "empty").stat().st_size == 0

        def refuse(*a: object) -> None:
            raise OSError(95, "Operation not supported")

        monkeypatch.setattr(os, "posix_fallocate", refuse)
        fd2 = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        preallocate(fd2, size)
        assert os.fstat(fd2).st_size == size
        os.close(fd2)
    finally:
        os.close(fd)

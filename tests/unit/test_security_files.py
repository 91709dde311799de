"""Metadata read from files is checked before it is used: names that would leave their directory,
sizes that do not fit their tensor, headers edited after a save, checkpoints changed since their
save. Every refusal leaves what was there before intact, and writes nothing anywhere else.

Built on the fixtures of tests/unit/test_sync_delta.py (weight checkpoints and deltas) and
tests/unit/test_train_checkpoint_fallback.py (real torch DCP checkpoints in tether's layout).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import re
import struct
from pathlib import Path

import msgspec
import pytest
import torch
from test_sync_delta import assert_same, make_delta, make_state, step, tensors_of, write
from test_train_checkpoint_fallback import _shard
from test_train_checkpoint_fallback import _write as write_checkpoint

from tether.rollout.engine_api.weights import PayloadRejected, decode_named_tensors, encode_named_tensors
from tether.runtime.files.safe_paths import UnsafePath
from tether.sync import cli
from tether.sync.checkpoint_files import INDEX_NAME, CheckpointError, open_checkpoint, verify_checkpoint
from tether.sync.delta import ChecksumMismatch, CorruptDelta, apply_delta
from tether.sync.delta_format import DELTA_INDEX, DeltaFormatError, read_index
from tether.sync.hf_writer import write_hf_checkpoint
from tether.sync.local_store import LocalCheckpointStore
from tether.train.checkpoint import load_save as checkpoint
from tether.train.checkpoint.retention import resolve_protected
from tether.train.model.hf_convert import HFWeights

CANARY = b"the canary: nothing may write here"


def weights_cli(*argv: str) -> int:
    """`tether weights ...` in this process (the same main the command runs)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(list(argv)))


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes, to show that a refusal changed nothing."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def chain(tmp_path: Path) -> list[Path]:
    """Three published versions of one model (each a small step from the last)."""
    states = [make_state()]
    for v in (1, 2):
        states.append(step(states[-1], 0.05 * v, seed=v))
    return [write(s, tmp_path / f"full_v{v}", v) for v, s in enumerate(states)]


# -- names that leave their directory ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_index_shard_outside_the_checkpoint_is_refused(
    tmp_path: Path, chain: list[Path], kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = chain[0]
    index = json.loads((ckpt / INDEX_NAME).read_text())
    name, shard = sorted(index["weight_map"].items())[0]
    # A real shard outside: were the name followed, reading and writing it would both succeed.
    canary = tmp_path / "canary.safetensors"
    canary.write_bytes((ckpt / shard).read_bytes())
    before = canary.read_bytes()
    bad = "../canary.safetensors" if kind == "relative" else str(canary)
    index["weight_map"] = {n: (bad if s == shard else s) for n, s in index["weight_map"].items()}
    (ckpt / INDEX_NAME).write_text(json.dumps(index))

    with pytest.raises(CheckpointError, match=rf"weight_map\[{re.escape(repr(name))}\].*refused"):
        with open_checkpoint(ckpt):
            pass
    with pytest.raises(UnsafePath, match=re.escape(repr(bad))):
        HFWeights(ckpt)
    assert weights_cli("verify", str(ckpt)) == 1
    assert bad in capsys.readouterr().err
    store = LocalCheckpointStore(tmp_path / "store")
    with pytest.raises(CheckpointError, match="refused"):
        store.seed(ckpt)
    assert store.version() is None
    assert canary.read_bytes() == before


@pytest.mark.parametrize("field", ["frame file", "frame file absolute", "weight_map shard"])
def test_delta_names_outside_the_delta_are_refused_and_nothing_is_written(
    tmp_path: Path, chain: list[Path], field: str
) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0])
    delta = make_delta(chain[0], chain[1], tmp_path / "d1")
    index = read_index(delta)
    name = index.changed()[0]
    # The target a crafted name points at: a file the applier could otherwise read or overwrite.
    canary = tmp_path / "canary.bin"
    canary.write_bytes(CANARY)
    if field.startswith("frame file"):
        bad = str(canary) if field.endswith("absolute") else "../canary.bin"
        frames = index.tensors[name].frames
        index.tensors[name].frames = [msgspec.structs.replace(f, file=bad) for f in frames]
        expected: type[Exception] = CorruptDelta
    else:
        # Relative to the new version's staging directory in the store: ../../canary.bin.
        bad = "../../canary.bin"
        index.tensors[name].shard = bad
        index.weight_map[name] = bad
        expected = DeltaFormatError
    (delta / DELTA_INDEX).write_bytes(msgspec.json.encode(index))
    outside = files_under(tmp_path / "full_v0") | {"canary": canary.read_bytes()}

    with pytest.raises(expected, match=re.escape(repr(bad))):
        store.apply(delta)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(expected, match="refused"):  # the applier on its own refuses it too
        apply_delta(chain[0], 0, delta, out)
    assert files_under(tmp_path / "full_v0") | {"canary": canary.read_bytes()} == outside
    assert store.version() == 0
    verify_checkpoint(store.current_path())  # type: ignore[arg-type]
    assert not [p for p in store.root.iterdir() if ".tmp-" in p.name]


def test_megatron_digests_naming_a_file_outside_are_refused(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path, 1)
    record = msgspec.msgpack.decode((d / checkpoint.DIGESTS).read_bytes(), type=checkpoint.CheckpointDigests)
    record.files["../../outside"] = checkpoint.FileDigest(size=1, xxh3_128="0" * 32)
    (d / checkpoint.DIGESTS).write_bytes(msgspec.msgpack.encode(record))
    with pytest.raises(ValueError, match=r"'\.\./\.\./outside' climbs out"):
        checkpoint.validate_checkpoint(d)


def test_hf_writer_layout_outside_the_directory_is_refused(tmp_path: Path) -> None:
    state = make_state()
    layout = dict.fromkeys(state, "../escaped.safetensors")
    with pytest.raises(UnsafePath, match="escaped"):
        write_hf_checkpoint(state.items(), tmp_path / "out", version=1, layout=layout)
    assert not (tmp_path / "escaped.safetensors").exists()


def test_shared_memory_names_in_a_tensor_payload_must_be_torchs(tmp_path: Path) -> None:
    keep: list[torch.Tensor] = []
    payload = encode_named_tensors([("w", torch.arange(8.0))], keep)
    assert torch.equal(decode_named_tensors(payload)[0][1], torch.arange(8.0))
    raw = base64.b64decode(payload)
    handle = re.search(rb"/torch_\d+_\d+_\d+", raw)
    assert handle is not None
    # Same length, so the pickle stays well formed: only the name is wrong.
    other = b"/../../" + b"x" * (len(handle.group(0)) - 7)
    with pytest.raises(PayloadRejected, match="handle"):
        decode_named_tensors(base64.b64encode(raw.replace(handle.group(0), other)))


# -- sizes that do not fit their tensor ------------------------------------------------------


def test_absurd_raw_length_is_refused_without_allocating(
    tmp_path: Path, chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    store = LocalCheckpointStore(tmp_path / "store")
    store.seed(chain[0])
    delta = make_delta(chain[0], chain[1], tmp_path / "d1")
    index = read_index(delta)
    name = index.changed()[0]
    frame = index.tensors[name].frames[0]
    index.tensors[name].frames[0] = msgspec.structs.replace(frame, raw_length=10**13)
    (delta / DELTA_INDEX).write_bytes(msgspec.json.encode(index))
    with pytest.raises(CorruptDelta, match=r"frames\[0\]\.raw_length=10000000000000"):
        store.apply(delta)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptDelta, match="raw_length=10000000000000"):
        apply_delta(chain[0], 0, delta, out)
    assert weights_cli("verify", str(delta)) == 1
    assert "raw_length=10000000000000" in capsys.readouterr().err
    assert store.version() == 0


def test_absurd_frame_length_is_refused_by_the_applier_alone(tmp_path: Path, chain: list[Path]) -> None:
    # apply_delta without verify_delta: a frame's compressed length is checked against its file.
    delta = make_delta(chain[0], chain[1], tmp_path / "d1")
    index = read_index(delta)
    name = index.changed()[0]
    index.tensors[name].frames[0] = msgspec.structs.replace(index.tensors[name].frames[0], length=10**13)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptDelta, match="truncated"):
        apply_delta(chain[0], 0, delta, out, index=index)


# -- a late refusal keeps every version ------------------------------------------------------


def test_a_late_refusal_keeps_the_previous_version(tmp_path: Path, chain: list[Path]) -> None:
    store = LocalCheckpointStore(tmp_path / "store", keep_previous=1)
    store.seed(chain[0])
    store.apply(make_delta(chain[0], chain[1], tmp_path / "d1"))
    v0, v1 = store.root / "weight_v000000", store.root / "weight_v000001"
    held = {v: files_under(v) for v in (v0, v1)}
    # The frames and base are right; only the result's recorded checksum is not: the refusal
    # comes after every new byte has been written.
    delta = make_delta(chain[1], chain[2], tmp_path / "d2")
    index = read_index(delta)
    name = index.changed()[0]
    index.tensors[name].checksum = "0" * len(index.tensors[name].checksum)
    (delta / DELTA_INDEX).write_bytes(msgspec.json.encode(index))
    with pytest.raises(ChecksumMismatch):
        store.apply(delta)
    assert store.version() == 1
    assert {v: files_under(v) for v in (v0, v1)} == held  # the previous version too, byte for byte
    verify_checkpoint(v0)
    verify_checkpoint(v1)
    assert not [p for p in store.root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    # The next good delta still applies, and only then is the oldest version pruned.
    store.apply(make_delta(chain[1], chain[2], tmp_path / "d2-good"))
    assert store.version() == 2 and not v0.exists()
    assert_same(tensors_of(store.current_path()), tensors_of(chain[2]))  # type: ignore[arg-type]


# -- safetensors headers edited after publication ---------------------------------------------


def _edit_header(ckpt: Path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` (same length) in the header of the shard holding it."""
    assert len(old) == len(new)
    for shard in sorted(ckpt.glob("*.safetensors")):
        raw = bytearray(shard.read_bytes())
        (header_len,) = struct.unpack("<Q", raw[:8])
        at = raw.find(old, 8, 8 + header_len)
        if at >= 0:
            raw[at : at + len(old)] = new
            shard.chmod(0o644)  # a store's files are read-only: the edit comes from their owner
            shard.write_bytes(bytes(raw))
            return
    raise AssertionError(f"{old!r} is in no header of {ckpt}")


# One flipped bit in a shape digit ('2' -> '3': the byte range no longer fits), and permuted
# dimensions (same byte count: only the layout recorded in the marker catches it).
HEADER_EDITS = {
    "one bit of a shape digit": (b'"shape":[48,32]', b'"shape":[48,33]'),
    "permuted shape": (b'"shape":[48,32]', b'"shape":[32,48]'),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_a_header_edit_fails_verify_seed_and_repair(
    tmp_path: Path, chain: list[Path], edit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (ord("2") ^ ord("3")).bit_count() == 1
    published = chain[1]
    assert weights_cli("verify", str(published)) == 0
    _edit_header(published, *HEADER_EDITS[edit])
    capsys.readouterr()

    assert weights_cli("verify", str(published)) == 1
    assert "model.layers.0.mlp.up_proj.weight" in capsys.readouterr().err

    assert weights_cli("seed", "--target", str(tmp_path / "fresh"), "--from", str(published)) == 1
    assert "up_proj" in capsys.readouterr().err
    assert LocalCheckpointStore(tmp_path / "fresh").version() is None

    store = tmp_path / "store"
    assert weights_cli("seed", "--target", str(store), "--from", str(chain[0])) == 0
    capsys.readouterr()
    assert weights_cli("repair", "--target", str(store), "--full", str(published)) == 1
    assert "up_proj" in capsys.readouterr().err
    assert LocalCheckpointStore(store).version() == 0

    # The store's own copy edited in place: `verify` of the store says so too.
    current = LocalCheckpointStore(store).current_path()
    assert current is not None
    _edit_header(current, *HEADER_EDITS[edit])
    assert weights_cli("verify", str(store)) == 1
    assert "up_proj" in capsys.readouterr().err


# -- Megatron checkpoints: digests before anything is unpickled -------------------------------


class _Canary:
    """A pickle that, when loaded, creates a directory: proof that it was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def test_a_bit_flip_in_a_distcp_shard_is_refused_before_load_and_the_previous_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_checkpoint(tmp_path, 1)
    newest = write_checkpoint(tmp_path, 2)
    shard = _shard(newest)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # one bit, same size: only a digest of the bytes sees it
    shard.write_bytes(bytes(raw))

    from torch.distributed.checkpoint import FileSystemReader

    def no_unpickling(*args: object, **kwargs: object) -> object:
        raise AssertionError("validating a checkpoint with digests unpickled its .metadata")

    monkeypatch.setattr(FileSystemReader, "read_metadata", no_unpickling)
    tried: list[Path] = []

    def load_one(path: Path) -> str:
        tried.append(path)
        return path.name

    got = checkpoint._load_first_loadable(tmp_path, "--load", load_one)
    assert got is not None
    _name, path, skipped = got
    assert tried == [tmp_path / "iter_0000001"] and path == str(tmp_path / "iter_0000001")
    assert [s.path for s in skipped] == [str(newest)]
    assert str(shard) in skipped[0].error and "xxh3-128" in skipped[0].error


def test_a_replaced_metadata_pickle_is_refused_without_being_unpickled(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path, 1)
    canary = tmp_path / "unpickled"
    (d / checkpoint.MODEL_OPTIM / ".metadata").write_bytes(pickle.dumps(_Canary(canary)))
    with pytest.raises(ValueError, match=r"\.metadata"):
        checkpoint.validate_checkpoint(d)
    assert not canary.exists()


def test_a_checkpoint_without_digests_loads_only_from_a_named_directory(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1)
    legacy = write_checkpoint(tmp_path, 2, digests=False)
    # --auto-resume scanning --save: the digest-less newest one is refused, the older one loads.
    path, skipped = checkpoint.select_checkpoint(tmp_path)
    assert path == tmp_path / "iter_0000001"
    assert [s.path for s in skipped] == [str(legacy)] and "--load" in skipped[0].error
    # --load / --ref-load naming the directory: trusted input, the newest is loaded.
    assert checkpoint.select_checkpoint(tmp_path, named=True) == (legacy, [])
    assert legacy in resolve_protected([tmp_path])  # retention protects what --load will load

    # Found by scanning, its .metadata is never unpickled; named, it is (that is the trust).
    canary = tmp_path / "unpickled"
    metadata = legacy / checkpoint.MODEL_OPTIM / ".metadata"
    real = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Canary(canary)))
    checkpoint.select_checkpoint(tmp_path)
    assert not canary.exists()
    metadata.write_bytes(real)

    # Only digest-less checkpoints under an unnamed directory: nothing loads, and it says why.
    only = tmp_path / "only"
    write_checkpoint(only, 1, digests=False)
    with pytest.raises(RuntimeError, match=r"--load=.*no digests\.msgpack"):
        checkpoint._load_first_loadable(only, "--load", lambda p: p)
    assert checkpoint._load_first_loadable(only, "--ref-load", lambda p: p, named=True) is not None

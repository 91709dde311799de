"""Training checkpoints in Megatron-LM's own layout, with tether's run state alongside.

Layout under the --save directory (Megatron-LM's, so Megatron-LM and slime load it too):

    latest_checkpointed_iteration.txt   "12", rewritten atomically after the rename
    iter_0000012/                       a complete checkpoint (renamed into place only when complete)
      metadata.json .metadata common.pt __R_N.distcp
                                        megatron.core.dist_checkpointing `torch_dist` (works on gloo):
                                        "model" (GPTModel.sharded_state_dict), "optimizer",
                                        "opt_param_scheduler", "iteration", "checkpoint_version"
                                        3.0, "args" (the Namespace Megatron-LM's load inspects)
      tether/run_state.msgpack          rollout id, data-source position, weight version, scheduler
      tether/rng/rank_00003.msgpack     per-rank RNG states: python, numpy, torch (CPU and CUDA), tracker
      tether/digests.msgpack            size and xxh3-128 of every other file, written last
    iter_0000013.tmp/                   a save in progress (or one a crash interrupted): never loaded

A save writes `iter_N.tmp` (each rank hashes the files it wrote; rank 0 gathers the digests,
hashes the rest and writes the digests file), then rank 0 fsyncs it, renames it to `iter_N` and
rewrites the tracker. A load tries the checkpoint the tracker names (or, when it names no
complete one, the newest complete `iter_*` directory), then the other complete ones, newest
first: a checkpoint whose files fail validation (a file missing, added, truncated or with one bit
flipped since the save; an unreadable run state) or whose load fails on any rank is skipped with
a warning naming it and the one used. Rank 0 validates and broadcasts the choice, and every rank
reports its load's outcome, so all ranks always load the same one.

Also loaded (see `tether.train.checkpoint.layout`): tether's previous layout (`latest` +
`iter_N/{model_optim/, run_state.msgpack, rng/, digests.msgpack}`), and checkpoints Megatron-LM
or slime wrote (tracker "12" → `iter_0000012/`, "release" → `release/`, or --load naming one
such directory). Those have no run state: iteration N resumes after step N (weights, optimizer
and scheduler; RNG as seeded), `release` gives weights only (Megatron-LM's iteration 0: a run
whose --load held it starts at rollout 1, as slime's does; `tether.run.job.fresh_start_rollout_id`).
Weights reshard across TP/PP (dist_checkpointing); optimizer state does not (dp_reshardable:
another DP size only), so a resume at another TP/PP is refused, naming both.
Tensors saved under TransformerEngine's names load into the local-spec model and the other way
round (`tether.train.checkpoint.names`); `_extra_state` entries (TE's FP8 scaling state) load
into a TransformerEngine model when the checkpoint has them, and are left out on the local spec.

Megatron's flags: --no-save-optim saves no optimizer state or LR schedule (a resume from such a
checkpoint starts a fresh optimizer, as Megatron-LM's load does); --no-load-optim /
--no-load-rng resume without them; --finetune loads weights only (Megatron-LM's iteration 0: a
fresh run, whose first rollout is 1 when --load held the checkpoint, as in slime);
--ckpt-step N loads `iter_N` (`layout.select_checkpoint_step`); --async-save writes
the files in the background and completes the checkpoint later (`tether.train.checkpoint.async_save`).
Another tool's checkpoint resumes with Adam's step from its optimizer param groups and the data
position from slime's `rollout/global_dataset_state_dict_N.pt` beside it (read by the head,
`tether.rollout.data.slime_state`, which also writes that file at each of tether's saves).

The digests are checked before anything is unpickled (torch's `.metadata`, `common.pt`). A
checkpoint without them (saved by an older tether, or by another tool) is loaded only from a
directory the user named (--load, --ref-load), as trusted input, never from one found by
--auto-resume. Digests catch damage, not a forger: checkpoints are trusted input, like torch.load.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import stat
import zipfile
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import xxhash

from tether.runtime.files.atomic_file import fsync_path, fsync_tree, write_bytes_atomic
from tether.runtime.files.safe_paths import contained
from tether.train.checkpoint import layout
from tether.train.checkpoint.layout import (
    DIGESTS,
    LEGACY_MODEL_DIR,
    LEGACY_TRACKER,
    RNG_DIR,
    RUN_STATE,
    TETHER_DIR,
    TRACKER,
    Layout,
    iter_dir_name,
)
from tether.train.model.build import Actor, sync_params, unwrap
from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.parallel.topology import all_true

log = logging.getLogger(__name__)
T = TypeVar("T")

LATEST = LEGACY_TRACKER  # tether's previous tracker file (still read)
MODEL_OPTIM = LEGACY_MODEL_DIR  # tether's previous layout kept the torch_dist files here
DIGESTS_FORMAT = "tether-checkpoint-digests"
_HASH_CHUNK = 16 * 1024**2
# How the distributed optimizer lays out its state: resumable at another DP size, same TP/PP.
# (In megatron-core 0.16.1 with torch's Adam, "fully_sharded_model_space" fails validation and
# "fully_reshardable" loses Adam's per-parameter "step".) Saved as the checkpoint's content
# metadata, the flags Megatron-LM's save writes, so its load asks the same keys back.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
CONTENT_METADATA = {**_OPTIM_METADATA, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class RunState(msgspec.Struct, kw_only=True):
    """What a resumed run needs besides weights and optimizer: where it was."""

    step: int
    rollout_id: int
    weight_version: int = 0
    data_position: dict[str, Any] = msgspec.field(default_factory=dict)
    scheduler: dict[str, Any] = msgspec.field(default_factory=dict)
    optimizer_step: int | None = None


class RngState(msgspec.Struct, kw_only=True):
    """One rank's random generators, as bytes (msgpack has no tensors)."""

    python: list[Any]
    numpy_state: tuple[str, bytes, int, int, float]
    torch_cpu: bytes
    torch_cuda: bytes | None
    tracker: dict[str, bytes]


class FileDigest(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a checkpoint as saved: its size and the xxh3-128 of its bytes."""

    size: int
    xxh3_128: str


class CheckpointDigests(msgspec.Struct, kw_only=True):
    """`digests.msgpack`: every file of the checkpoint directory (relative POSIX paths) but itself."""

    format: str = DIGESTS_FORMAT
    files: dict[str, FileDigest]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()


def capture_rng() -> RngState:
    """This rank's RNG states (the Megatron tracker holds the model-parallel dropout streams)."""
    with quiet_megatron_imports():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    return RngState(
        python=_to_lists(random.getstate()),
        numpy_state=(
            str(version),
            np.asarray(keys, dtype=np.uint32).tobytes(),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        torch_cpu=_tensor_bytes(torch.get_rng_state()),
        torch_cuda=_tensor_bytes(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
        tracker={k: _tensor_bytes(v) for k, v in get_cuda_rng_tracker().get_states().items()},
    )


def restore_rng(state: RngState) -> None:
    with quiet_megatron_imports():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(_to_tuples(state.python))
    version, keys, pos, has_gauss, cached = state.numpy_state
    np.random.set_state((version, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state.torch_cpu))
    if state.torch_cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state.torch_cuda))
    get_cuda_rng_tracker().set_states({k: _bytes_tensor(v) for k, v in state.tracker.items()})


def _to_lists(x: Any) -> Any:
    return [_to_lists(i) for i in x] if isinstance(x, tuple | list) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(i) for i in x) if isinstance(x, list) else x


def _inner_optimizers(actor: Actor) -> list[Any]:
    return [opt.optimizer for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]


def _adam_step(actor: Actor) -> int | None:
    for inner in _inner_optimizers(actor):
        for st in inner.state.values():
            if "step" in st:
                return int(st["step"])
    return None


def _any_rank_adam_step(actor: Actor) -> int | None:
    """Adam's step as any rank knows it: rank 0 writes the run state, and may train no parameter
    (a frozen pipeline stage) while the others do."""
    mine = _adam_step(actor)
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    steps: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, mine)
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def _restore_adam_step(actor: Actor, step: int) -> None:
    # megatron-core 0.16.1's distributed-optimizer load does not restore torch Adam's per-param
    # "step" (bias correction); every parameter steps together, so one saved count restores it.
    for inner in _inner_optimizers(actor):
        for st in inner.state.values():
            if "step" in st:
                old = st["step"]
                st["step"] = torch.full_like(old, float(step)) if torch.is_tensor(old) else step


def _model_keys(chunks: list[Any]) -> list[str]:
    """Megatron-LM's state-dict keys of the model chunks: "model", or "model0", "model1", ..."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_state(chunks: list[Any], metadata: dict[str, Any] | None) -> dict[str, Any]:
    # The bare GPTModel: DDP would prefix "module." and could not load into a reference model.
    # A copy each: Megatron stores the current DP group into the metadata dict it is handed, and a
    # module-level dict would carry a destroyed layout's group into the next save.
    return {
        key: unwrap(chunk).sharded_state_dict(metadata=None if metadata is None else dict(metadata))
        for key, chunk in zip(_model_keys(chunks), chunks, strict=True)
    }


def _optimizer_state(
    actor: Actor, model_sd: dict[str, Any], *, is_loading: bool, metadata: dict[str, Any]
) -> Any:
    flat: dict[str, Any] = {}
    for sub in model_sd.values():
        flat.update(sub)
    if is_loading:
        # A fresh distributed optimizer has no Adam state yet ("step" missing); Megatron fills it
        # with placeholders that the load overwrites.
        for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
            init_dummy = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if init_dummy is not None and not opt.optimizer.state:
                init_dummy()
    return actor.optimizer.sharded_state_dict(flat, is_loading=is_loading, metadata=dict(metadata))


def _sharded_state(actor: Actor, *, is_loading: bool) -> dict[str, Any]:
    """Model and optimizer as tether's previous layout saved them (model_optim/)."""
    model_sd = _model_state(actor.chunks, None)
    optim = _optimizer_state(actor, model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA)
    return {**model_sd, "optimizer": optim}


def _hash_file(path: Path) -> FileDigest:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(size=size, xxh3_128=h.hexdigest())


def _hash_files(root: Path, names: Iterable[str]) -> dict[str, FileDigest]:
    """Digests of files under root (relative POSIX names), several files at once (xxhash and
    file reads release the GIL)."""
    ordered = sorted(names)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="ckpt-digest") as pool:
        return dict(zip(ordered, pool.map(lambda n: _hash_file(root / n), ordered), strict=True))


def _listing(root: Path, digests: str = DIGESTS) -> tuple[list[str], list[str]]:
    """Regular files under root as relative POSIX names (the digests file `digests` left out),
    and the entries that are neither files nor directories (links, sockets): a save writes none."""
    files: list[str] = []
    other: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # symlinked directories are not entered
        here = Path(dirpath)
        for name in [*dirnames, *filenames]:
            rel = (here / name).relative_to(root).as_posix()
            mode = (here / name).lstat().st_mode
            if stat.S_ISREG(mode):
                if rel != digests:
                    files.append(rel)
            elif not stat.S_ISDIR(mode):
                other.append(rel)
    return sorted(files), sorted(other)


def _files_of_rank(root: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote in a save (torch DCP names its shards `__<rank>_<n>.distcp`);
    it hashes them while they are in its page cache. Rank 0 hashes whatever no rank claimed."""
    mine = [p.name for p in root.glob(f"__{rank}_*.distcp")]
    rng = f"{TETHER_DIR}/{RNG_DIR}/rank_{rank:05d}.msgpack"
    if (root / rng).is_file():
        mine.append(rng)
    return mine


def write_digests(
    path: Path, known: Mapping[str, FileDigest] | None = None, *, name: str | None = None
) -> CheckpointDigests:
    """Record every file of checkpoint directory `path` in its digests file, atomically.

    `known` digests (hashed by the ranks that wrote those files) are taken as they are; every
    other file is hashed here. Run once all of the checkpoint's other files are written.
    `name`: the digests file, relative to `path` (default: where `path`'s layout keeps it).
    """
    name = name or layout.digests_name(path)
    files, other = _listing(path, name)
    if other:
        raise ValueError(f"{path}: entries that are not regular files cannot be recorded: {other[:5]}")
    given = {f: known[f] for f in files if known and f in known}
    digests = {**given, **_hash_files(path, [f for f in files if f not in given])}
    record = CheckpointDigests(files=dict(sorted(digests.items())))
    write_bytes_atomic(path / name, msgspec.msgpack.encode(record))
    return record


def check_digests(path: Path) -> None:
    """Raise ValueError naming the first file of checkpoint `path` that is missing, was added, or
    differs in size or xxh3 from what its digests file recorded at the save."""
    name = layout.digests_name(path)
    record_file = path / name
    try:
        record = msgspec.msgpack.decode(record_file.read_bytes(), type=CheckpointDigests)
    except (OSError, msgspec.DecodeError) as exc:
        raise _bad(record_file, exc) from None
    if record.format != DIGESTS_FORMAT:
        raise _bad(record_file, f"format={record.format!r}; this tether reads {DIGESTS_FORMAT!r}")
    for entry in record.files:
        contained(path, entry, entry=f"{name} file", error=ValueError)
    files, other = _listing(path, name)
    missing = sorted(set(record.files) - set(files))
    if missing:
        raise _bad(path / missing[0], f"recorded in {DIGESTS} but missing")
    added = sorted({*files, *other} - set(record.files))
    if added:
        raise _bad(path / added[0], f"not recorded in {DIGESTS}: added or replaced after the save")
    for f, want in sorted(record.files.items()):  # sizes first: cheap, and a truncation says so
        size = (path / f).stat().st_size
        if size != want.size:
            how = "truncated" if size < want.size else "grown"
            raise _bad(path / f, f"{size} bytes, but {DIGESTS} records {want.size} ({how})")
    got = _hash_files(path, record.files)
    for f, want in sorted(record.files.items()):
        if got[f] != want:
            raise _bad(
                path / f,
                f"xxh3-128 {got[f].xxh3_128} ({got[f].size} bytes) != {want.xxh3_128} "
                f"({want.size} bytes) recorded in {DIGESTS}: the file changed since the save",
            )


def save(actor: Actor, save_dir: str | Path, state: RunState, *, save_optim: bool = True) -> Path:
    """Write checkpoint `iter_{state.step}` in Megatron-LM's layout, tether's run state in its
    `tether/` folder; collective over every rank of the job. `save_optim=False` (--no-save-optim):
    the weights without the optimizer state and LR schedule, as Megatron-LM writes them then."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    root, tmp, final = begin_save(save_dir, state.step)
    sharded = save_state(actor, state, save_optim=save_optim)
    dist_checkpointing.save(sharded, str(tmp), content_metadata=dict(CONTENT_METADATA))
    return finish_save(root, tmp, final, state, capture_rng())


def begin_save(save_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    """(root, `iter_N.tmp`, `iter_N`) of a save of `step`, with an empty `.tmp` directory made
    (what an interrupted save left there is removed). Collective."""
    root = Path(save_dir)
    final = root / iter_dir_name(step)
    tmp = root / f"{iter_dir_name(step)}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    return root, tmp, final


def save_state(actor: Actor, state: RunState, *, save_optim: bool) -> dict[str, Any]:
    """The sharded state dict a save writes (Megatron-LM's keys); fills the run state's
    scheduler and Adam step (empty without the optimizer)."""
    from tether.train.checkpoint.megatron import common_state

    sync_params(actor.chunks)
    state.scheduler = actor.scheduler.state_dict() if save_optim else {}
    state.optimizer_step = _any_rank_adam_step(actor) if save_optim else None
    model_sd = _model_state(actor.chunks, CONTENT_METADATA)
    sharded: dict[str, Any] = dict(model_sd)
    if save_optim:
        sharded["optimizer"] = _optimizer_state(actor, model_sd, is_loading=False, metadata=CONTENT_METADATA)
    scheduler = actor.scheduler if save_optim else None  # Megatron-LM saves neither without the optimizer
    sharded.update(common_state(actor.chunks, actor.config, iteration=state.step, scheduler=scheduler))
    return sharded


def finish_save(root: Path, tmp: Path, final: Path, state: RunState, rng: RngState) -> Path:
    """Complete a save whose torch_dist files are all in `tmp`: each rank's RNG state, the digests
    of every file, then (rank 0) the run state, fsync, the rename to `final` and the tracker.
    Until the rename nothing names the new checkpoint: a crash leaves the previous one current."""
    rank = dist.get_rank()
    rng_dir = tmp / TETHER_DIR / RNG_DIR
    rng_dir.mkdir(parents=True, exist_ok=True)  # after the save: dist_checkpointing wants it empty
    write_bytes_atomic(rng_dir / f"rank_{rank:05d}.msgpack", msgspec.msgpack.encode(rng))
    dist.barrier()
    # Every rank hashes its own files (spreading the reads); rank 0 gathers and records them.
    mine = _hash_files(tmp, _files_of_rank(tmp, rank))
    gathered: list[dict[str, FileDigest] | None] | None = (
        [None] * dist.get_world_size() if rank == 0 else None
    )
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        write_bytes_atomic(tmp / TETHER_DIR / RUN_STATE, msgspec.msgpack.encode(state))
        known = {name: d for part in gathered or [] for name, d in (part or {}).items()}
        write_digests(tmp, known, name=f"{TETHER_DIR}/{DIGESTS}")  # last: it records every other file
        fsync_tree(tmp)
        if final.exists():  # re-saving the same step: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)
        write_bytes_atomic(root / TRACKER, str(state.step).encode())
    dist.barrier()
    return final


def save_release(chunks: list[Any], config: Any, save_dir: str | Path) -> Path:
    """Write the model's weights as `release/` with the tracker saying "release": the layout
    slime's HF->torch_dist converter writes (no optimizer, RNG or run state). Atomic: written to
    `release.tmp`, renamed, then the tracker. Collective over every rank."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    from tether.train.checkpoint.megatron import common_state

    root = Path(save_dir)
    final, tmp = root / layout.RELEASE, root / f"{layout.RELEASE}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    sharded: dict[str, Any] = {
        **_model_state(chunks, CONTENT_METADATA),
        **common_state(chunks, config, iteration=0, scheduler=None),
    }
    dist_checkpointing.save(sharded, str(tmp), content_metadata=dict(CONTENT_METADATA))
    dist.barrier()
    if dist.get_rank() == 0:
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)
        write_bytes_atomic(root / TRACKER, layout.RELEASE.encode())
    dist.barrier()
    return final


def complete_checkpoints(root: Path) -> list[int]:
    """Steps with a complete checkpoint directory tether wrote under root (either of its
    layouts), ascending."""
    return layout.complete_steps(Path(root))


def find_checkpoint(load_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: `load_dir` itself when it is one; the one the tracker names
    (`latest_checkpointed_iteration.txt`, or tether's older `latest`); or the newest complete one."""
    return layout.first_candidate(Path(load_dir))


class SkippedCheckpoint(msgspec.Struct, frozen=True):
    """A complete checkpoint directory that could not be loaded, and why."""

    path: str
    error: str


class Loaded(msgspec.Struct, kw_only=True):
    """What `load_checkpoint` restored: the run state, from which directory, what it skipped."""

    state: RunState
    path: str
    skipped: list[SkippedCheckpoint] = msgspec.field(default_factory=list)


def checkpoint_candidates(load_dir: str | Path) -> list[Path]:
    """Complete checkpoints in the order a load tries them: `find_checkpoint`'s, then newest first."""
    return layout.candidates(Path(load_dir))


def validate_checkpoint(path: Path, *, named: bool = False) -> None:
    """Check that every file of a checkpoint is whole and readable, without loading tensors.

    Raises ValueError naming the file. With tether's digests: a file missing, added, or not the
    size or xxh3 recorded at the save (nothing is unpickled), or a run state or RNG state that
    does not decode. Without them the checkpoint is refused unless `named` (the user named its
    directory with --load/--ref-load; not one found by --auto-resume), and then checked as
    trusted input: run and RNG states decode, Megatron's metadata parses (torch's `.metadata` is
    unpickled), `common.pt` passes its CRC check, no shard is shorter than the byte ranges the
    checkpoint's index says it holds (a truncated file).
    """
    if (path / layout.digests_name(path)).exists():
        check_digests(path)
        _check_states(path)
        return
    if not named:
        raise ValueError(
            f"{path}: no {DIGESTS} (saved by another tool or an older tether, or tampered with); "
            "a checkpoint without tether's digests is loaded only from a directory named by "
            "--load or --ref-load, as trusted input"
        )
    _check_states(path)
    _check_undigested(path)


def _bad(file: Path, why: object) -> ValueError:
    return ValueError(f"{file}: {why}")


def _check_states(path: Path) -> None:
    """The run state and RNG states decode (msgspec, typed: no code runs); none in a checkpoint
    another tool wrote."""
    if layout.layout_of(path) is Layout.MEGATRON:
        return
    where = layout.state_dir(path)
    run_state = where / RUN_STATE
    try:
        msgspec.msgpack.decode(run_state.read_bytes(), type=RunState)
    except (OSError, msgspec.DecodeError) as exc:
        raise _bad(run_state, exc) from None
    for rng_file in sorted((where / RNG_DIR).glob("rank_*.msgpack")):
        try:
            msgspec.msgpack.decode(rng_file.read_bytes(), type=RngState)
        except (OSError, msgspec.DecodeError) as exc:
            raise _bad(rng_file, exc) from None


def _check_undigested(path: Path) -> None:
    """Whole-file checks of a trusted checkpoint that has no digests (it unpickles `.metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader

    bad = _bad
    model_dir = layout.model_dir(path)
    meta_json = model_dir / "metadata.json"
    try:
        json.loads(meta_json.read_text())
    except (OSError, ValueError) as exc:
        raise bad(meta_json, exc) from None
    common = model_dir / "common.pt"
    if common.exists():
        try:
            with zipfile.ZipFile(common) as archive:
                broken = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            raise bad(common, exc) from None
        if broken is not None:
            raise bad(common, f"member {broken!r} fails its CRC check")
    try:
        metadata = FileSystemReader(str(model_dir)).read_metadata()
    except Exception as exc:  # an unpickling error can be of many types
        raise bad(model_dir / ".metadata", f"{type(exc).__name__}: {exc}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = contained(model_dir, name, entry=".metadata storage relative_path", error=ValueError)
        try:
            size = shard.stat().st_size
        except OSError as exc:
            raise bad(shard, exc) from None
        if size < end:
            raise bad(shard, f"{size} bytes, but the checkpoint index needs {end} (truncated)")


def select_checkpoint(
    load_dir: str | Path, exclude: Collection[str] = (), *, named: bool = False
) -> tuple[Path | None, list[SkippedCheckpoint]]:
    """The first candidate not in `exclude` whose files validate, and those skipped before it.
    `named`: the user named `load_dir` (see `validate_checkpoint`)."""
    skipped: list[SkippedCheckpoint] = []
    for path in checkpoint_candidates(load_dir):
        if str(path) in exclude:
            continue
        try:
            validate_checkpoint(path, named=named)
        except ValueError as exc:
            skipped.append(SkippedCheckpoint(str(path), str(exc)))
            log.warning("checkpoint %s is damaged (%s); trying an older complete one", path, exc)
            continue
        return path, skipped
    return None, skipped


def _agree(value: Any) -> Any:
    """Rank 0's value on every rank (the value itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _load_first_loadable(
    load_dir: str | Path, flag: str, load_one: Callable[[Path], T], *, named: bool = False
) -> tuple[T, str, list[SkippedCheckpoint]] | None:
    """`load_one` on the newest complete checkpoint whose files validate and that loads on every
    rank, skipping damaged ones (each warned about); None when `load_dir` holds no complete
    checkpoint, an error naming `flag` when it holds only damaged ones. `named`: the user named
    `load_dir` (see `validate_checkpoint`). Collective over every rank."""
    skipped: list[SkippedCheckpoint] = []
    while True:
        choice: str | None = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Rank 0 decides; the others take its choice, so all ranks load the same directory.
            path, newly = select_checkpoint(load_dir, exclude={s.path for s in skipped}, named=named)
            choice, skipped = (None if path is None else str(path)), [*skipped, *newly]
        choice, skipped = _agree((choice, skipped))
        if choice is None:
            if skipped:
                raise RuntimeError(
                    f"{flag}={load_dir}: every complete checkpoint is damaged or cannot load here: "
                    + "; ".join(f"{s.path}: {s.error}" for s in skipped)
                )
            return None
        error = ""
        try:
            result = load_one(Path(choice))
        except Exception as exc:  # any rank's failure makes every rank move on together
            error = f"{type(exc).__name__}: {exc}"
            log.exception("loading checkpoint %s failed", choice)
        if all_true(not error):
            for bad in skipped:
                log.warning("checkpoint %s was damaged (%s); loaded %s instead", bad.path, bad.error, choice)
            return result, choice, skipped
        skipped.append(SkippedCheckpoint(choice, error or "the load failed on another rank"))


def load_checkpoint(
    actor: Actor,
    load_dir: str | Path,
    *,
    finetune: bool = False,
    named: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
) -> Loaded | None:
    """Restore model, optimizer, scheduler and RNG from the newest loadable complete checkpoint.

    Returns what was loaded (with the damaged checkpoints skipped on the way, each warned
    about), or None when `load_dir` holds no loadable checkpoint (an error when it holds only
    damaged ones). With `finetune` only the weights are loaded and the run starts fresh from
    them (the state says step -1: nothing trained yet). `named`: the user named `load_dir` with
    --load, so its checkpoints without digests are loadable (trusted input); False for
    --auto-resume. `load_optim=False` (--no-load-optim): a fresh optimizer and LR schedule, the
    run position still restored; `load_rng=False` (--no-load-rng): RNG as seeded. A checkpoint
    saved without its optimizer (--no-save-optim) resumes with a fresh one, as in Megatron-LM.
    Collective over every rank.
    """
    got = _load_first_loadable(
        load_dir,
        "--load",
        lambda path: _load_from(actor, path, finetune=finetune, load_optim=load_optim, load_rng=load_rng),
        named=named,
    )
    if got is None:
        return None
    state, path, skipped = got
    return Loaded(state=state, path=path, skipped=skipped)


def load(
    actor: Actor,
    load_dir: str | Path,
    *,
    finetune: bool = False,
    named: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
) -> RunState | None:
    """`load_checkpoint`'s run state only (None when there is no checkpoint)."""
    loaded = load_checkpoint(
        actor, load_dir, finetune=finetune, named=named, load_optim=load_optim, load_rng=load_rng
    )
    return None if loaded is None else loaded.state


def fresh_state() -> RunState:
    """The state of weights loaded without a run position: no step of this run is in them yet."""
    return RunState(step=-1, rollout_id=-1)


def _load_model(chunks: list[Any], path: Path) -> None:
    """Only the model weights of checkpoint `path` (any layout) into `chunks`."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    if layout.layout_of(path) is Layout.LEGACY:
        keys = _model_keys(chunks)
        sharded = {k: unwrap(c).sharded_state_dict() for k, c in zip(keys, chunks, strict=True)}
        loaded = dist_checkpointing.load(sharded, str(path / MODEL_OPTIM))
        for k, chunk in zip(keys, chunks, strict=True):
            unwrap(chunk).load_state_dict(loaded[k], strict=True)
        return
    loaded, _ = _load_megatron(chunks, path, None)
    _apply_model(chunks, loaded)


def _load_megatron(
    chunks: list[Any], path: Path, optimizer: Callable[[dict[str, Any]], Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """dist_checkpointing.load of the model (each tensor asked under the name the checkpoint has
    it, `_extra_state` left out but on a TE model) and, when `optimizer` builds its request from the model's, the
    optimizer state. Returns (loaded state dict, the checkpoint's content metadata)."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    from tether.train.checkpoint import hf_wrapped_layers
    from tether.train.checkpoint.megatron import (
        ask_checkpoint_names,
        content_metadata,
        drop_extra_state,
        extra_state_to_load,
        tensors_metadata,
    )

    metadata = content_metadata(path) or dict(CONTENT_METADATA)
    model_sd = _model_state(chunks, metadata)
    tensors = tensors_metadata(path)
    available = set(tensors)
    extra = extra_state_to_load(chunks, path)  # TE's FP8 state, on a TE model only
    # slime's Qwen3-Next/Qwen3.5 linear attention (transformers' modules inside its spec), converted.
    wrapped = hf_wrapped_layers.holds_wrapped_layers(available)
    plans = {}
    for key, chunk in zip(_model_keys(chunks), chunks, strict=True):
        sub = model_sd[key]
        if wrapped:
            plans[key] = hf_wrapped_layers.plan(chunk, sub, tensors)
        drop_extra_state(sub, keep=extra)
        renamed = ask_checkpoint_names(sub, available)
        if renamed:
            log.info("%s: %d tensors under their other layer spec's names", path, len(renamed))
    sharded: dict[str, Any] = dict(model_sd)
    if optimizer is not None:
        if wrapped:
            raise ValueError(
                f"{path}: resuming slime's optimizer state of transformers-module linear attention "
                "is not supported (its layout differs from Megatron's GatedDeltaNet); load the weights "
                "with --no-load-optim (or as --ref-load)"
            )
        sharded["optimizer"] = optimizer({**metadata})
    for key, found in plans.items():
        sharded[_WRAPPED + key] = found.requests
    loaded = dist_checkpointing.load(sharded, str(path))
    for key, found in plans.items():
        loaded[_WRAPPED + key] = (found, loaded[_WRAPPED + key])
    return loaded, metadata


# Where _load_megatron keeps a chunk's converted slime linear-attention tensors in its result.
_WRAPPED = "hf_wrapped_layers/"


def _apply_model(chunks: list[Any], loaded: dict[str, Any]) -> None:
    from tether.train.checkpoint import hf_wrapped_layers
    from tether.train.checkpoint.names import is_extra_state

    for key, chunk in zip(_model_keys(chunks), chunks, strict=True):
        result = unwrap(chunk).load_state_dict(loaded[key], strict=False)
        converted: set[str] = set()
        if _WRAPPED + key in loaded:
            found, tensors = loaded[_WRAPPED + key]
            hf_wrapped_layers.apply(chunk, found, tensors)
            converted = found.replaced
        wrong = [k for k in result.missing_keys if not is_extra_state(k) and k not in converted] + list(
            result.unexpected_keys
        )
        if wrong:
            raise KeyError(f"checkpoint state does not fit the model: {sorted(wrong)[:8]}")


def reload_main_params(actor: Actor) -> None:
    """The optimizer's main (fp32) copies of the weights follow weights loaded without it."""
    reload = getattr(actor.optimizer, "reload_model_params", None)
    if reload is not None:
        reload()


def _load_from(actor: Actor, path: Path, *, finetune: bool, load_optim: bool, load_rng: bool) -> RunState:
    kind = layout.layout_of(path)
    if kind is Layout.LEGACY:
        return _load_legacy(actor, path, finetune=finetune, load_optim=load_optim, load_rng=load_rng)
    if finetune:
        _load_model(actor.chunks, path)
        reload_main_params(actor)
        return fresh_state()
    if kind is Layout.TETHER:
        from tether.train.checkpoint.megatron import load_common

        common = load_common(path)
        state = msgspec.msgpack.decode((path / TETHER_DIR / RUN_STATE).read_bytes(), type=RunState)
        if _resumes_optimizer(path, common, load_optim):
            _check_same_parallel_sizes(path, common)
            loaded, _ = _load_megatron(actor.chunks, path, lambda md: _optimizer_for(actor, md))
            _apply_model(actor.chunks, loaded)
            _restore_training_state(actor, loaded["optimizer"], state.scheduler, state.optimizer_step)
        else:
            _load_model(actor.chunks, path)
            reload_main_params(actor)
        if load_rng:
            _restore_rank_rng(path / TETHER_DIR / RNG_DIR, path)
        return state
    return _load_foreign(actor, path, load_optim=load_optim)


_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def _holds_optimizer(path: Path, common: Mapping[str, Any]) -> bool:
    """The checkpoint has optimizer state (not saved with --no-save-optim)."""
    from tether.train.checkpoint.megatron import tensor_keys

    args = common.get("args")
    # Megatron chains one optimizer per parameter group kind (dense, experts): `chained_N.optimizer.`
    return not getattr(args, "no_save_optim", False) and any(
        _OPTIMIZER_KEY.match(k) for k in tensor_keys(path)
    )


def _resumes_optimizer(path: Path, common: Mapping[str, Any], load_optim: bool) -> bool:
    """Whether a resume restores the optimizer and LR schedule: asked for and in the checkpoint.
    Otherwise they start fresh (Megatron-LM: the scheduler loads only with the optimizer)."""
    if not load_optim:
        log.info("%s: --no-load-optim: a fresh optimizer and LR schedule", path)
        return False
    if not _holds_optimizer(path, common):
        log.warning("%s holds no optimizer state (--no-save-optim): resuming with a fresh optimizer", path)
        return False
    return True


def _optimizer_for(actor: Actor, metadata: dict[str, Any]) -> Any:
    model_sd = _model_state(actor.chunks, metadata)
    return _optimizer_state(actor, model_sd, is_loading=True, metadata=metadata)


def _load_foreign(actor: Actor, path: Path, *, load_optim: bool = True) -> RunState:
    """A checkpoint Megatron-LM or slime wrote: no run state. `release` (a converted model) gives
    weights only and the run starts at step 0; iteration N resumes after step N (slime saves the
    rollout id as the iteration) with the optimizer (Adam's step included: Megatron keeps it in
    the optimizer's param groups) and scheduler it holds, a fresh optimizer when it holds none
    (--no-save-optim) or --no-load-optim says so; RNG as seeded. The data position is slime's
    file beside the checkpoints (`tether.rollout.data.slime_state`), which the head reads."""
    from tether.train.checkpoint.megatron import load_common

    iteration = layout.iteration_of(path)
    common = load_common(path)
    if iteration is None:
        _load_model(actor.chunks, path)
        reload_main_params(actor)
        log.warning("%s: a release checkpoint: its weights only (iteration 0)", path)
        return fresh_state()
    if not _resumes_optimizer(path, common, load_optim):
        # As Megatron-LM and slime: the iteration still counts, the optimizer starts fresh.
        _load_model(actor.chunks, path)
        reload_main_params(actor)
        return RunState(step=iteration, rollout_id=iteration)
    _check_same_parallel_sizes(path, common)
    loaded, _ = _load_megatron(actor.chunks, path, lambda md: _optimizer_for(actor, md))
    _apply_model(actor.chunks, loaded)
    scheduler = common.get("opt_param_scheduler") or {}
    _restore_training_state(actor, loaded["optimizer"], scheduler, None)
    log.info("%s: Megatron checkpoint of iteration %d; RNG states are seeded, not restored", path, iteration)
    return RunState(step=iteration, rollout_id=iteration, scheduler=dict(scheduler))


def _check_same_parallel_sizes(path: Path, common: Mapping[str, Any]) -> None:
    """A resume (optimizer state: dp_reshardable) needs the TP and PP sizes it was saved at."""
    from megatron.core import parallel_state as ps

    from tether.train.checkpoint.megatron import saved_parallel_sizes

    saved = saved_parallel_sizes(dict(common))
    here = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    if saved != here:
        raise ValueError(
            f"{path} was saved at TP={saved[0]} PP={saved[1]}, this run has TP={here[0]} PP={here[1]}: "
            "its optimizer state loads only at the same TP and PP (weights reshard, optimizer state "
            f"does not). Resume at TP={saved[0]} PP={saved[1]}, or start from its weights with "
            f"--ref-load {path.parent} and no --load"
        )


def saved_adam_step(optimizer_state: Any) -> int | None:
    """Adam's step count in a loaded Megatron optimizer state: the distributed optimizer keeps it
    as "step" in each param group (torch's Adam keeps it per parameter, TE's FusedAdam per group).
    None when no group has one (an SGD state, or a state saved before any step)."""
    steps: set[float] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            groups = node.get("param_groups")
            if isinstance(groups, list):
                for group in groups:
                    step = group.get("step") if isinstance(group, Mapping) else None
                    if step is not None:
                        steps.add(float(step.item() if torch.is_tensor(step) else step))
            for value in node.values():
                walk(value)
        elif isinstance(node, list | tuple):
            for value in node:
                walk(value)

    walk(optimizer_state)
    if not steps:
        return None
    if len(steps) > 1:
        raise ValueError(f"the optimizer state's param groups disagree on Adam's step: {sorted(steps)}")
    return int(steps.pop())


def _fill_common_step(optimizer_state: Any, step: int) -> None:
    """Give Adam's per-parameter states the step where the checkpoint carries none.

    Megatron saves the step once, as the optimizer's `common_step`, in the checkpoint's common
    (rank-0) part; when rank 0 trains no parameter (a frozen pipeline stage), there is none, and
    the other ranks' Adam states come back without a step. tether's run state holds it."""
    if isinstance(optimizer_state, Mapping):
        state = optimizer_state.get("state")
        if isinstance(state, dict) and "common_step" not in state:
            params = [v for k, v in state.items() if isinstance(v, Mapping)]
            if params and any("step" not in v for v in params):
                state["common_step"] = torch.tensor(float(step))
        for value in optimizer_state.values():
            _fill_common_step(value, step)
    elif isinstance(optimizer_state, list | tuple):
        for value in optimizer_state:
            _fill_common_step(value, step)


def _restore_training_state(
    actor: Actor, optimizer_state: Any, scheduler: Mapping[str, Any], optimizer_step: int | None
) -> None:
    if optimizer_step is None:  # another tool's checkpoint: Adam's step from its param groups
        optimizer_step = saved_adam_step(optimizer_state)  # read before the load consumes the state
    if optimizer_step is not None:
        _fill_common_step(optimizer_state, optimizer_step)
    with torch.no_grad():  # Megatron copies into leaf main params in place
        actor.optimizer.load_state_dict(optimizer_state)
    if optimizer_step is not None:
        _restore_adam_step(actor, optimizer_step)
    if scheduler:
        actor.scheduler.load_state_dict(dict(scheduler))


def _restore_rank_rng(rng_dir: Path, path: Path) -> None:
    rng_file = rng_dir / f"rank_{dist.get_rank():05d}.msgpack"
    if rng_file.is_file():
        restore_rng(msgspec.msgpack.decode(rng_file.read_bytes(), type=RngState))
    else:
        log.warning(
            "%s has no RNG state for rank %d (different world size); RNG not restored", path, dist.get_rank()
        )


def _load_legacy(
    actor: Actor, path: Path, *, finetune: bool, load_optim: bool = True, load_rng: bool = True
) -> RunState:
    """tether's previous layout (model_optim/, run_state.msgpack and rng/ at the top)."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    if finetune:
        _load_model(actor.chunks, path)
        reload_main_params(actor)
        return fresh_state()
    state = msgspec.msgpack.decode((path / RUN_STATE).read_bytes(), type=RunState)
    if load_optim:
        sharded = _sharded_state(actor, is_loading=True)
        loaded = dist_checkpointing.load(sharded, str(path / MODEL_OPTIM))
        for key, chunk in zip(_model_keys(actor.chunks), actor.chunks, strict=True):
            unwrap(chunk).load_state_dict(loaded[key], strict=True)
        _restore_training_state(actor, loaded["optimizer"], state.scheduler, state.optimizer_step)
    else:
        _load_model(actor.chunks, path)
        reload_main_params(actor)
    if load_rng:
        _restore_rank_rng(path / RNG_DIR, path)
    return state


def load_weights_only(chunks: list[Any], load_dir: str | Path, *, named: bool = True) -> Path:
    """Load only model weights (e.g. a frozen reference from --ref-load) from the newest
    loadable complete checkpoint, past damaged ones as `load_checkpoint` does; returns the
    directory. Any layout, saved at any TP/PP. `named` defaults to True: --ref-load is always a
    directory the user named. Collective over every rank."""
    got = _load_first_loadable(load_dir, "--ref-load", lambda path: _load_model(chunks, path), named=named)
    if got is None:
        raise FileNotFoundError(
            f"--ref-load={load_dir}: no complete checkpoint ({TRACKER} naming iter_XXXXXXX/ or "
            f"release/, an iter_XXXXXXX/ or release/ directory itself, or tether's iter_*/ checkpoints)"
        )
    return Path(got[1])

"""Training checkpoints: Megatron distributed checkpoint of model + optimizer, plus the run state.

Layout under the --save directory:

    iter_0000012/            a complete checkpoint (renamed into place only when complete)
      model_optim/           megatron.core.dist_checkpointing, `torch_dist` format (works on gloo)
      rng/rank_00003.msgpack per-rank RNG states: python, numpy, torch (CPU and CUDA), Megatron tracker
      run_state.msgpack      rollout id, data-source position, weight version, LR scheduler state
      digests.msgpack        size and xxh3-128 of every other file, written last
    iter_0000013.tmp/        a save in progress (or one a crash interrupted): never loaded
    latest                   "12", rewritten atomically after the rename

A save writes `iter_N.tmp` (each rank hashes the files it wrote; rank 0 gathers the digests,
hashes the rest and writes `digests.msgpack`), then rank 0 fsyncs it, renames it to `iter_N` and
rewrites `latest`. A load tries the checkpoint `latest` names (or, when it names no complete
one, the newest complete `iter_*` directory), then the other complete ones, newest first: a
checkpoint whose files fail validation (a file missing, added, truncated or with one bit flipped
since the save; an unreadable run state) or whose load fails on any rank is skipped with a
warning naming it and the one used. Rank 0 validates and broadcasts the choice, and every rank
reports its load's outcome, so all ranks always load the same one.

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

from tether.runtime.atomic_file import fsync_path, fsync_tree, write_bytes_atomic
from tether.runtime.safe_paths import contained
from tether.train.megatron_cpu import quiet_megatron_imports
from tether.train.model import Actor, sync_params, unwrap
from tether.train.parallel import all_true

log = logging.getLogger(__name__)
T = TypeVar("T")

LATEST = "latest"
RUN_STATE = "run_state.msgpack"
MODEL_OPTIM = "model_optim"
DIGESTS = "digests.msgpack"
DIGESTS_FORMAT = "tether-checkpoint-digests"
_HASH_CHUNK = 16 * 1024**2
_ITER = re.compile(r"^iter_(\d{7})$")
# How the distributed optimizer lays out its state: resumable at another DP size, same TP/PP.
# (In megatron-core 0.16.1 with torch's Adam, "fully_sharded_model_space" fails validation and
# "fully_reshardable" loses Adam's per-parameter "step".)
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


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


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


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


def _restore_adam_step(actor: Actor, step: int) -> None:
    # megatron-core 0.16.1's distributed-optimizer load does not restore torch Adam's per-param
    # "step" (bias correction); every parameter steps together, so one saved count restores it.
    for inner in _inner_optimizers(actor):
        for st in inner.state.values():
            if "step" in st:
                old = st["step"]
                st["step"] = torch.full_like(old, float(step)) if torch.is_tensor(old) else step


def _sharded_state(actor: Actor, *, is_loading: bool) -> dict[str, Any]:
    model_sd: dict[str, Any] = {}
    for i, chunk in enumerate(actor.chunks):
        key = "model" if len(actor.chunks) == 1 else f"model{i}"
        # The bare GPTModel: DDP would prefix "module." and could not load into a reference model.
        model_sd[key] = unwrap(chunk).sharded_state_dict()
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
    optim = actor.optimizer.sharded_state_dict(flat, is_loading=is_loading, metadata=_OPTIM_METADATA)
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


def _listing(root: Path) -> tuple[list[str], list[str]]:
    """Regular files under root as relative POSIX names (the digests file left out), and the
    entries that are neither files nor directories (links, sockets): a save writes none."""
    files: list[str] = []
    other: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # symlinked directories are not entered
        here = Path(dirpath)
        for name in [*dirnames, *filenames]:
            rel = (here / name).relative_to(root).as_posix()
            mode = (here / name).lstat().st_mode
            if stat.S_ISREG(mode):
                if rel != DIGESTS:
                    files.append(rel)
            elif not stat.S_ISDIR(mode):
                other.append(rel)
    return sorted(files), sorted(other)


def _files_of_rank(root: Path, rank: int) -> list[str]:
    """The files rank `rank` wrote in a save (torch DCP names its shards `__<rank>_<n>.distcp`);
    it hashes them while they are in its page cache. Rank 0 hashes whatever no rank claimed."""
    mine = [f"{MODEL_OPTIM}/{p.name}" for p in (root / MODEL_OPTIM).glob(f"__{rank}_*.distcp")]
    if (root / "rng" / f"rank_{rank:05d}.msgpack").is_file():
        mine.append(f"rng/rank_{rank:05d}.msgpack")
    return mine


def write_digests(path: Path, known: Mapping[str, FileDigest] | None = None) -> CheckpointDigests:
    """Record every file of checkpoint directory `path` in its digests file, atomically.

    `known` digests (hashed by the ranks that wrote those files) are taken as they are; every
    other file is hashed here. Run once all of the checkpoint's other files are written.
    """
    files, other = _listing(path)
    if other:
        raise ValueError(f"{path}: entries that are not regular files cannot be recorded: {other[:5]}")
    given = {name: known[name] for name in files if known and name in known}
    digests = {**given, **_hash_files(path, [name for name in files if name not in given])}
    record = CheckpointDigests(files=dict(sorted(digests.items())))
    write_bytes_atomic(path / DIGESTS, msgspec.msgpack.encode(record))
    return record


def check_digests(path: Path) -> None:
    """Raise ValueError naming the first file of checkpoint `path` that is missing, was added, or
    differs in size or xxh3 from what its digests file recorded at the save."""
    record_file = path / DIGESTS
    try:
        record = msgspec.msgpack.decode(record_file.read_bytes(), type=CheckpointDigests)
    except (OSError, msgspec.DecodeError) as exc:
        raise _bad(record_file, exc) from None
    if record.format != DIGESTS_FORMAT:
        raise _bad(record_file, f"format={record.format!r}; this tether reads {DIGESTS_FORMAT!r}")
    for name in record.files:
        contained(path, name, entry=f"{DIGESTS} file", error=ValueError)
    files, other = _listing(path)
    missing = sorted(set(record.files) - set(files))
    if missing:
        raise _bad(path / missing[0], f"recorded in {DIGESTS} but missing")
    added = sorted({*files, *other} - set(record.files))
    if added:
        raise _bad(path / added[0], f"not recorded in {DIGESTS}: added or replaced after the save")
    for name, want in sorted(record.files.items()):  # sizes first: cheap, and a truncation says so
        size = (path / name).stat().st_size
        if size != want.size:
            how = "truncated" if size < want.size else "grown"
            raise _bad(path / name, f"{size} bytes, but {DIGESTS} records {want.size} ({how})")
    got = _hash_files(path, record.files)
    for name, want in sorted(record.files.items()):
        if got[name] != want:
            raise _bad(
                path / name,
                f"xxh3-128 {got[name].xxh3_128} ({got[name].size} bytes) != {want.xxh3_128} "
                f"({want.size} bytes) recorded in {DIGESTS}: the file changed since the save",
            )


def save(actor: Actor, save_dir: str | Path, state: RunState) -> Path:
    """Write checkpoint `iter_{state.step}`; collective over every rank of the job."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    root = Path(save_dir)
    final = root / iter_dir_name(state.step)
    tmp = root / f"{iter_dir_name(state.step)}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / MODEL_OPTIM).mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    sync_params(actor.chunks)
    state.scheduler = actor.scheduler.state_dict()
    state.optimizer_step = _adam_step(actor)
    dist_checkpointing.save(_sharded_state(actor, is_loading=False), str(tmp / MODEL_OPTIM))
    write_bytes_atomic(tmp / "rng" / f"rank_{rank:05d}.msgpack", msgspec.msgpack.encode(capture_rng()))
    dist.barrier()
    # Every rank hashes its own files (spreading the reads); rank 0 gathers and records them.
    mine = _hash_files(tmp, _files_of_rank(tmp, rank))
    gathered: list[dict[str, FileDigest] | None] | None = (
        [None] * dist.get_world_size() if rank == 0 else None
    )
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        write_bytes_atomic(tmp / RUN_STATE, msgspec.msgpack.encode(state))
        known = {name: d for part in gathered or [] for name, d in (part or {}).items()}
        write_digests(tmp, known)  # last: it records every other file
        fsync_tree(tmp)
        if final.exists():  # re-saving the same step: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(root)
        write_bytes_atomic(root / LATEST, str(state.step).encode())
    dist.barrier()
    return final


def complete_checkpoints(root: Path) -> list[int]:
    """Steps with a complete checkpoint directory under root, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = _ITER.match(entry.name)
        if m and entry.is_dir() and (entry / RUN_STATE).is_file() and (entry / MODEL_OPTIM).is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_checkpoint(load_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: the one `latest` names, or the newest complete one."""
    root = Path(load_dir)
    complete = complete_checkpoints(root)
    marker = root / LATEST
    if marker.is_file():
        text = marker.read_text().strip()
        if text.isdigit() and int(text) in complete:
            return root / iter_dir_name(int(text))
        if complete:
            log.warning(
                "%s names step %r, which has no complete checkpoint; loading the newest complete one, step %d",
                marker,
                text,
                complete[-1],
            )
    if complete:
        return root / iter_dir_name(complete[-1])
    return None


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
    root = Path(load_dir)
    first = find_checkpoint(root)
    if first is None:
        return []
    rest = [root / iter_dir_name(step) for step in reversed(complete_checkpoints(root))]
    return [first, *(p for p in rest if p != first)]


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
    if (path / DIGESTS).exists():
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
    """The run state and RNG states decode (msgspec, typed: no code runs)."""
    bad = _bad
    run_state = path / RUN_STATE
    try:
        msgspec.msgpack.decode(run_state.read_bytes(), type=RunState)
    except (OSError, msgspec.DecodeError) as exc:
        raise bad(run_state, exc) from None
    for rng_file in sorted((path / "rng").glob("rank_*.msgpack")):
        try:
            msgspec.msgpack.decode(rng_file.read_bytes(), type=RngState)
        except (OSError, msgspec.DecodeError) as exc:
            raise bad(rng_file, exc) from None


def _check_undigested(path: Path) -> None:
    """Whole-file checks of a trusted checkpoint that has no digests (it unpickles `.metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader

    bad = _bad
    model_dir = path / MODEL_OPTIM
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
                    f"{flag}={load_dir}: every complete checkpoint is damaged: "
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
    actor: Actor, load_dir: str | Path, *, finetune: bool = False, named: bool = False
) -> Loaded | None:
    """Restore model, optimizer, scheduler and RNG from the newest loadable complete checkpoint.

    Returns what was loaded (with the damaged checkpoints skipped on the way, each warned
    about), or None when `load_dir` holds no loadable checkpoint (an error when it holds only
    damaged ones). With `finetune` only the weights are loaded (the run starts fresh from
    them). `named`: the user named `load_dir` with --load, so its checkpoints without digests
    are loadable (trusted input); False for --auto-resume. Collective over every rank.
    """
    got = _load_first_loadable(
        load_dir, "--load", lambda path: _load_from(actor, path, finetune=finetune), named=named
    )
    if got is None:
        return None
    state, path, skipped = got
    return Loaded(state=state, path=path, skipped=skipped)


def load(
    actor: Actor, load_dir: str | Path, *, finetune: bool = False, named: bool = False
) -> RunState | None:
    """`load_checkpoint`'s run state only (None when there is no checkpoint)."""
    loaded = load_checkpoint(actor, load_dir, finetune=finetune, named=named)
    return None if loaded is None else loaded.state


def _load_from(actor: Actor, path: Path, *, finetune: bool) -> RunState:
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    sharded = _sharded_state(actor, is_loading=True)
    if finetune:
        sharded.pop("optimizer")
    loaded = dist_checkpointing.load(sharded, str(path / MODEL_OPTIM))
    for i, chunk in enumerate(actor.chunks):
        key = "model" if len(actor.chunks) == 1 else f"model{i}"
        unwrap(chunk).load_state_dict(loaded[key], strict=True)
    state = msgspec.msgpack.decode((path / RUN_STATE).read_bytes(), type=RunState)
    if finetune:
        return state
    with torch.no_grad():  # Megatron copies into leaf main params in place
        actor.optimizer.load_state_dict(loaded["optimizer"])
    if state.optimizer_step is not None:
        _restore_adam_step(actor, state.optimizer_step)
    if state.scheduler:
        actor.scheduler.load_state_dict(state.scheduler)
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.msgpack"
    if rng_file.is_file():
        restore_rng(msgspec.msgpack.decode(rng_file.read_bytes(), type=RngState))
    else:
        log.warning(
            "%s has no RNG state for rank %d (different world size); RNG not restored", path, dist.get_rank()
        )
    return state


def load_weights_only(chunks: list[Any], load_dir: str | Path, *, named: bool = True) -> Path:
    """Load only model weights (e.g. a frozen reference from --ref-load) from the newest
    loadable complete checkpoint, past damaged ones as `load_checkpoint` does; returns the
    directory. `named` defaults to True: --ref-load is always a directory the user named.
    Collective over every rank."""
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]

    def load_one(path: Path) -> None:
        with quiet_megatron_imports():
            from megatron.core import dist_checkpointing

        sharded = {k: unwrap(c).sharded_state_dict() for k, c in zip(keys, chunks, strict=True)}
        loaded = dist_checkpointing.load(sharded, str(path / MODEL_OPTIM))
        for k, chunk in zip(keys, chunks, strict=True):
            unwrap(chunk).load_state_dict(loaded[k], strict=True)

    got = _load_first_loadable(load_dir, "--ref-load", load_one, named=named)
    if got is None:
        raise FileNotFoundError(f"--ref-load={load_dir}: no complete checkpoint (iter_*/ with {RUN_STATE})")
    return Path(got[1])

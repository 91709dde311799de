"""Diff, apply and verify weight deltas (the delta-disk mode), on raw tensor bytes.

Encoding and applying run frame by frame on a thread pool: numpy, zstandard and xxhash release
the GIL, so frames proceed in parallel. Apply builds a new checkpoint beside the base and costs
what changed: files without a changed tensor are reused (reflink where the filesystem has it,
else a hard link, else a copy); each changed shard is a new file, a reflink of the base shard
patched where frames land, or, without reflinks, written in one pass (base ^ delta, or the base's
bytes where nothing changed, straight from the base's mmap). The written shards are verified
against the delta's checksums, the reused ones through the base's marker (their bytes are the
base's own), and only then is the result published by the caller (see tether.sync.local_store).

Nothing here writes into an existing file: every write goes to a file this apply created with
O_EXCL in its staging directory, and finished shards are made read-only, so a file shared by
hard link between versions is never modified through either name.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import shutil
import stat
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np
import zstandard

from tether.runtime.files.safe_paths import contained
from tether.sync.checkpoint_files import (
    MARKER_NAME,
    ST_ITEMSIZE,
    CheckpointError,
    CheckpointView,
    TensorSlot,
    WeightsMarker,
    check_layout,
    open_checkpoint,
    read_marker,
)
from tether.sync.checksum import checksum_fn, frame_digest
from tether.sync.delta_format import (
    DeltaFormatError,
    DeltaFrame,
    DeltaIndex,
    DeltaTensor,
    read_index,
    write_index,
)

FRAME_BYTES = 16 * 1024**2  # raw bytes per frame: small enough to spread over threads
DATA_FILE = "delta-00000.bin"


class RawTensor(NamedTuple):
    """One tensor as bytes: safetensors dtype name, shape, and a uint8 array (a view, not a copy)."""

    dtype: str
    shape: list[int]
    data: np.ndarray


class DeltaRefused(Exception):
    """A delta cannot be applied to this target; the target was left untouched."""


class WrongBase(DeltaRefused):
    """The target is not at the delta's base version, or its bytes are not the base's."""


class VersionGap(DeltaRefused):
    """The target is older than the delta's base: deltas in between are missing."""


class ChecksumMismatch(DeltaRefused):
    """The result of applying a delta fails its recorded checksums."""


class CorruptDelta(DeltaRefused):
    """The delta's files are truncated or corrupted."""


def _data_path(delta_dir: Path, file: str) -> Path:
    return contained(delta_dir, file, entry="delta frame file", error=CorruptDelta)


def resolve_threads(threads: int) -> int:
    return threads if threads > 0 else (os.cpu_count() or 1)


def _elements(data: np.ndarray, dtype: str) -> np.ndarray:
    """View raw bytes as unsigned ints of the dtype's width, so diffs work per element."""
    size = ST_ITEMSIZE.get(dtype, 1)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(size)
    if width is None or data.size % size:
        return data
    return data.view(width)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        super().__init__()
        self.compressor = zstandard.ZstdCompressor(level=1)
        self.decompressor = zstandard.ZstdDecompressor()
        self.buffers = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]

    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """A reused per-thread buffer (slot 0 or 1): fresh 16 MiB allocations cost page faults."""
        if self.buffers[slot].size < nbytes:
            self.buffers[slot] = np.empty(nbytes, dtype=np.uint8)
        return self.buffers[slot][:nbytes]


class _Encoded(NamedTuple):
    name: str
    op: str
    start: int
    count_: int
    raw_length: int
    n_changed: int
    blob: bytes


def _encode_frame(
    state: _ThreadState, name: str, encoding: str, base: np.ndarray, new: np.ndarray, start: int
) -> _Encoded | None:
    count = new.size
    nbytes = new.nbytes
    if encoding == "xor":
        out = state.scratch(nbytes).view(new.dtype)
        np.bitwise_xor(base, new, out=out)
        if not out.any():
            return None
        return _Encoded(name, "xor", start, count, nbytes, -1, state.compressor.compress(out.data))
    changed = np.flatnonzero(base != new)
    if changed.size == 0:
        return None
    if changed.size * (new.itemsize + 4) >= nbytes:
        return _Encoded(
            name, "full", start, count, nbytes, int(changed.size), state.compressor.compress(new.data)
        )
    gaps = np.diff(changed, prepend=0).astype(np.uint32)
    payload = gaps.tobytes() + new[changed].tobytes()
    return _Encoded(
        name, "overwrite", start, count, len(payload), int(changed.size), state.compressor.compress(payload)
    )


def encode_delta(
    base: Mapping[str, RawTensor],
    new: Mapping[str, RawTensor],
    out_dir: Path,
    *,
    version: int,
    base_version: int,
    weight_map: Mapping[str, str],
    encoding: str = "xor",
    checksum: str = "xxh3-128",
    threads: int = 0,
    frame_bytes: int = FRAME_BYTES,
) -> DeltaIndex:
    """Write the delta from base to new into out_dir (an existing empty staging directory)."""
    if encoding not in ("xor", "overwrite"):
        raise ValueError(f"encoding={encoding!r}: choose 'xor' or 'overwrite'")
    if version <= base_version:
        raise ValueError(f"version={version} must be after base_version={base_version}")
    digest = checksum_fn(checksum)
    if set(base) != set(new) or set(new) != set(weight_map):
        diff = sorted(set(base) ^ set(new) | set(new) ^ set(weight_map))
        raise ValueError(
            f"base, new and weight map name different tensors (deltas need one layout): {diff[:5]}"
        )
    tensors: dict[str, DeltaTensor] = {}
    for name in sorted(new):
        b, n = base[name], new[name]
        if b.dtype != n.dtype or list(b.shape) != list(n.shape) or b.data.nbytes != n.data.nbytes:
            raise ValueError(
                f"tensor {name!r}: base {b.dtype}{list(b.shape)} vs new {n.dtype}{list(n.shape)}; "
                "deltas need equal dtypes and shapes (publish a full version instead)"
            )
        tensors[name] = DeltaTensor(
            dtype=n.dtype, shape=list(n.shape), nbytes=n.data.nbytes, shard=weight_map[name], checksum="",
            base_checksum="",
        )  # fmt: skip

    state = _ThreadState()

    def frame_jobs() -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
        for name in sorted(new):
            b = _elements(base[name].data, new[name].dtype)
            n = _elements(new[name].data, new[name].dtype)
            step = max(1, frame_bytes // max(1, n.itemsize))
            for s in range(0, n.size, step):
                yield name, b[s : s + step], n[s : s + step], s

    def hash_job(name: str) -> tuple[str, str, str]:
        return name, digest(new[name].data), digest(base[name].data)

    written = 0
    with ThreadPoolExecutor(resolve_threads(threads), thread_name_prefix="delta-encode") as pool:
        hashes = [pool.submit(hash_job, name) for name in tensors]
        window: deque[Future[_Encoded | None]] = deque()
        limit = 2 * resolve_threads(threads)
        with open(out_dir / DATA_FILE, "wb") as data_file:

            def drain(keep: int) -> None:
                nonlocal written
                while len(window) > keep:
                    enc = window.popleft().result()
                    if enc is None:
                        continue
                    tensors[enc.name].frames.append(
                        DeltaFrame(
                            op=enc.op,  # type: ignore[arg-type]
                            file=DATA_FILE,
                            offset=written,
                            length=len(enc.blob),
                            start=enc.start,
                            count=enc.count_,
                            raw_length=enc.raw_length,
                            n_changed=enc.n_changed,
                            digest=frame_digest(enc.blob),
                        )
                    )
                    data_file.write(enc.blob)
                    written += len(enc.blob)

            for name, base_part, new_part, first in frame_jobs():
                window.append(pool.submit(_encode_frame, state, name, encoding, base_part, new_part, first))
                drain(limit)
            drain(0)
        for fut in hashes:
            name, new_sum, base_sum = fut.result()
            tensors[name].checksum, tensors[name].base_checksum = new_sum, base_sum
    index = DeltaIndex(
        version=version,
        base_version=base_version,
        encoding=encoding,  # type: ignore[arg-type]
        checksum=checksum,
        weight_map=dict(sorted(weight_map.items())),
        tensors=tensors,
        full_bytes=sum(t.nbytes for t in tensors.values()),
        delta_bytes=written,
    )
    write_index(out_dir, index)
    return index


def checkpoint_tensors(view: CheckpointView) -> dict[str, RawTensor]:
    return {name: RawTensor(s.dtype, s.shape, view.bytes_of(name)) for name, s in view.slots.items()}


def check_frames(delta_dir: Path, index: DeltaIndex) -> None:
    """Refuse (CorruptDelta naming the tensor, field and value) any frame whose sizes do not fit
    the tensor it patches (dtype × shape) or whose data file is outside the delta directory, so
    nothing is allocated or read on the word of a damaged or crafted index."""
    for name, t in index.tensors.items():

        def bad(field: str, value: object, why: str, name: str = name) -> CorruptDelta:
            return CorruptDelta(f"{delta_dir}: tensor {name!r}: {field}={value!r} {why}")

        if any(d < 0 for d in t.shape):
            raise bad("shape", t.shape, "has a negative dimension")
        # A dtype without a known size (no torch equivalent) is checked against the target's
        # header instead, in check_base.
        itemsize = ST_ITEMSIZE.get(t.dtype)
        if itemsize is not None and t.nbytes != itemsize * math.prod(t.shape):
            raise bad("nbytes", t.nbytes, f"but {t.dtype}{t.shape} is {itemsize * math.prod(t.shape)} bytes")
        width = _element_size(t.dtype, t.nbytes)
        elements = t.nbytes // width
        for i, fr in enumerate(t.frames):
            where = f"frames[{i}]"
            _data_path(delta_dir, fr.file)
            for field in ("offset", "length", "start", "count"):
                if getattr(fr, field) < 0:
                    raise bad(f"{where}.{field}", getattr(fr, field), "is negative")
            if fr.start + fr.count > elements:
                raise bad(
                    f"{where}.start+count",
                    fr.start + fr.count,
                    f"covers elements past the tensor's end ({elements} elements)",
                )
            if fr.op == "overwrite":
                if not 0 < fr.n_changed <= fr.count:
                    raise bad(f"{where}.n_changed", fr.n_changed, f"is not in 1..count={fr.count}")
                expected = fr.n_changed * (4 + width)  # uint32 gaps, then the values
            else:
                expected = fr.count * width
            if fr.raw_length != expected:
                raise bad(
                    f"{where}.raw_length",
                    fr.raw_length,
                    f"but a {fr.op} frame of {fr.count} elements of {width} bytes holds {expected}",
                )


def verify_delta(delta_dir: Path) -> DeltaIndex:
    """Check a delta's index and that every frame is present and matches its digest."""
    index = read_index(delta_dir)
    check_frames(Path(delta_dir), index)
    sizes: dict[str, int] = {}
    for name, t in index.tensors.items():
        for fr in t.frames:
            path = _data_path(Path(delta_dir), fr.file)
            if fr.file not in sizes:
                if not path.exists():
                    raise CorruptDelta(f"{delta_dir}: data file {fr.file!r} is missing")
                sizes[fr.file] = path.stat().st_size
            if fr.offset + fr.length > sizes[fr.file]:
                raise CorruptDelta(
                    f"{path}: truncated: frame of {name!r} ends at byte {fr.offset + fr.length} "
                    f"but the file has {sizes[fr.file]}"
                )
            with open(path, "rb") as f:
                blob = os.pread(f.fileno(), fr.length, fr.offset)
            if frame_digest(blob) != fr.digest:
                raise CorruptDelta(f"{path}: frame of {name!r} at byte {fr.offset} fails its digest")
    return index


class _Write(NamedTuple):
    """One piece of a new shard file: bytes [offset, offset+length) either copied from the base
    shard (frame None) or rebuilt from the base and one delta frame."""

    shard: str
    offset: int
    length: int
    name: str = ""
    frame: DeltaFrame | None = None


def _element_size(dtype: str, nbytes: int) -> int:
    """The width of the elements frames index (what _elements views the bytes as)."""
    size = ST_ITEMSIZE.get(dtype, 1)
    return size if size in (1, 2, 4, 8) and nbytes % size == 0 else 1


def _plan_shard(
    shard: str, file_size: int, view: CheckpointView, index: DeltaIndex, chunk: int, *, gaps: bool = True
) -> list[_Write]:
    """Cover the whole new shard file: each frame's byte range, and base copies for the gaps
    (gaps=False: only the frames, for a file that already holds the base's bytes: a reflink)."""
    pieces: list[_Write] = []
    for name, t in index.tensors.items():
        if t.shard != shard or not t.frames:
            continue
        slot = view.slots[name]
        width = _element_size(t.dtype, slot.end - slot.start)
        for fr in t.frames:
            start = slot.start + fr.start * width
            if fr.start < 0 or fr.count < 0 or start + fr.count * width > slot.end:
                raise CorruptDelta(
                    f"{index.version}: frame of {name!r} covers elements past the tensor's end"
                )
            pieces.append(_Write(shard, start, fr.count * width, name, fr))
    pieces.sort(key=lambda w: w.offset)
    plan: list[_Write] = []
    cursor = 0
    for piece in [*pieces, _Write(shard, file_size, 0)]:
        if piece.offset < cursor:
            raise CorruptDelta(f"frames of {piece.name!r} overlap another frame of shard {shard!r}")
        if gaps:
            plan.extend(
                _Write(shard, off, min(chunk, piece.offset - off))
                for off in range(cursor, piece.offset, chunk)
            )
        if piece.frame is not None:
            plan.append(piece)
        cursor = piece.offset + piece.length
    return plan


def preallocate(fd: int, size: int) -> None:
    """Give a new file all its `size` bytes of disk now: pieces written later in any order then
    fill allocated blocks. A sparse file (ftruncate) makes the filesystem allocate at every
    write: measured on ext4, writing 1 GiB in 16 MiB pieces ran at 0.1-0.2 GB/s into a sparse
    file and 1.3-1.5 GB/s into a preallocated one. Where the filesystem cannot preallocate, the
    file is only sized."""
    if size > 0:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError:
            pass  # not supported here (e.g. some network filesystems): sized, not allocated
    os.ftruncate(fd, size)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _ShardWriter:
    """Writes every changed shard of a delta's result in one pass: base ^ delta (or the base's
    bytes where nothing changed) goes straight from the read-only base maps into the new files
    with pwrite, one piece per thread-pool job; no copy-then-patch, no msync. Each shard is
    fdatasync'ed on a side thread as soon as its last piece is written, so flushing overlaps the
    writing of the next shards and the publisher's fsync of the directory finds little to do."""

    def __init__(self, view: CheckpointView, delta_dir: Path, out_dir: Path) -> None:
        self.view = view
        self.delta_dir = delta_dir
        self.out_dir = out_dir
        self.state = _ThreadState()
        self.out_fds: dict[str, int] = {}
        self.delta_fds: dict[str, int] = {}
        self.delta_sizes: dict[str, int] = {}

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in [*self.out_fds.values(), *self.delta_fds.values()]:
            os.close(fd)

    def open_shard(self, shard: str, size: int, base: Path | None = None) -> bool:
        """Create the new shard file (in out_dir, a staging directory only this apply writes):
        a reflink of `base` where the filesystem has them (True: only the frames need writing),
        else an empty file of `size` bytes (False: every byte is written)."""
        path = contained(self.out_dir, shard, entry="delta weight_map shard", error=CorruptDelta)
        # O_EXCL (here and in clone_file): never write through a file or link already there.
        fd = clone_file(base, path) if base is not None else None
        if fd is not None:
            self.out_fds[shard] = fd
            return True
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.out_fds[shard] = fd
        preallocate(fd, size)
        return False

    def _finish(self, shard: str) -> None:
        fd = self.out_fds[shard]
        os.fchmod(fd, READ_ONLY)  # made durable by the publisher's fsync of every file
        os.fdatasync(fd)

    def _delta_fd(self, file: str) -> int:
        fd = self.delta_fds.get(file)
        if fd is None:
            path = _data_path(self.delta_dir, file)
            try:
                fd = self.delta_fds[file] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptDelta(f"{self.delta_dir}: data file {file!r} is missing") from None
            self.delta_sizes[file] = os.fstat(fd).st_size
        return fd

    def _decompress(self, fr: DeltaFrame, name: str) -> np.ndarray:
        path = self.delta_dir / fr.file
        # Checked before reading: pread allocates the length it is asked for.
        if fr.offset + fr.length > self.delta_sizes[fr.file]:
            raise CorruptDelta(f"{path}: truncated: frame of {name!r} at byte {fr.offset} is short")
        blob = os.pread(self.delta_fds[fr.file], fr.length, fr.offset)
        if len(blob) != fr.length:
            raise CorruptDelta(f"{path}: truncated: frame of {name!r} at byte {fr.offset} is short")
        if frame_digest(blob) != fr.digest:
            raise CorruptDelta(f"{path}: frame of {name!r} at byte {fr.offset} fails its digest")
        out = self.state.scratch(fr.raw_length, 0)
        got = 0
        try:
            with self.state.decompressor.stream_reader(blob) as reader:
                view = memoryview(out)  # type: ignore[arg-type]
                while got < fr.raw_length:
                    n = reader.readinto(view[got:])
                    if not n:
                        break
                    got += n
                extra = reader.read(1) if got == fr.raw_length else b""
        except zstandard.ZstdError as exc:
            raise CorruptDelta(f"{path}: frame of {name!r} does not decompress: {exc}") from exc
        if got != fr.raw_length or extra:
            raise CorruptDelta(
                f"{path}: frame of {name!r} decompressed to a length other than {fr.raw_length}"
            )
        return out

    def write(self, piece: _Write) -> None:
        fd = self.out_fds[piece.shard]
        base = self.view.shard_bytes(piece.shard)[piece.offset : piece.offset + piece.length]
        fr = piece.frame
        if fr is None:
            _pwrite_all(fd, base, piece.offset)
            return
        t = self.view.slots[piece.name]
        width = _element_size(t.dtype, t.end - t.start)
        base_el = _elements(base, t.dtype) if width > 1 else base
        raw = self._decompress(fr, piece.name)
        if fr.op == "xor":
            if fr.raw_length != piece.length:
                raise CorruptDelta(f"{fr.file}: xor frame of {piece.name!r} does not match its element range")
            result = raw.view(base_el.dtype)
            np.bitwise_xor(base_el, result, out=result)
        elif fr.op == "full":
            if fr.raw_length != piece.length:
                raise CorruptDelta(
                    f"{fr.file}: full frame of {piece.name!r} does not match its element range"
                )
            result = raw
        else:
            result = self.state.scratch(piece.length, 1).view(base_el.dtype)
            result[:] = base_el
            if fr.raw_length != fr.n_changed * (4 + base_el.itemsize):
                raise CorruptDelta(f"{fr.file}: overwrite frame of {piece.name!r} has a wrong length")
            gaps = raw[: 4 * fr.n_changed].view(np.uint32)
            values = raw[4 * fr.n_changed :].view(base_el.dtype)
            positions = np.cumsum(gaps, dtype=np.int64)
            if fr.n_changed and positions[-1] >= result.size:
                raise CorruptDelta(f"{fr.file}: frame of {piece.name!r} writes past the tensor's end")
            result[positions] = values
        _pwrite_all(fd, result, piece.offset)

    def run(self, plan: list[_Write], pool: ThreadPoolExecutor) -> None:
        left: dict[str, int] = {}
        for piece in plan:
            left[piece.shard] = left.get(piece.shard, 0) + 1
            if piece.frame is not None:
                self._delta_fd(piece.frame.file)
        with ThreadPoolExecutor(1, thread_name_prefix="delta-fsync") as syncer:
            syncs: list[Future[None]] = []
            writes = [pool.submit(self.write, p) for p in plan]
            try:
                for piece, fut in zip(plan, writes, strict=True):
                    fut.result()  # in plan order: shards finish one after another
                    left[piece.shard] -= 1
                    if left[piece.shard] == 0:
                        syncs.append(syncer.submit(self._finish, piece.shard))
            except BaseException:
                # No job may outlive the file descriptors it writes to (closed on exit).
                for fut in writes:
                    fut.cancel()
                wait(writes)
                raise
            for sync in syncs:
                sync.result()


READ_ONLY = 0o444  # the mode of every file of a built version: it is only ever replaced
FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): make a file share another's blocks
# What FICLONE answers where the filesystem (ext4, tmpfs, most network filesystems) or the pair
# of files cannot share blocks: the caller falls back to a hard link or a copy.
_NO_REFLINK_ERRNOS = frozenset(
    {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}
)
_no_reflink: set[tuple[int, int]] = set()  # (source, target) devices that refused a reflink


def clone_file(src: Path, dst: Path) -> int | None:
    """Create dst (a new name: O_EXCL) as a reflink of src, sharing its blocks copy-on-write so
    that writing either file never changes the other, and return it open for writing; None
    (dst not created) where the filesystem cannot, remembered per pair of devices."""
    devices = (os.stat(src).st_dev, os.stat(dst.parent).st_dev)
    if devices in _no_reflink:
        return None
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        src_fd = os.open(src, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FICLONE, src_fd)
        finally:
            os.close(src_fd)
    except BaseException as exc:
        os.close(fd)
        dst.unlink()
        if isinstance(exc, OSError) and exc.errno in _NO_REFLINK_ERRNOS:
            _no_reflink.add(devices)
            return None
        raise
    return fd


def make_read_only(path: Path) -> None:
    """Drop every write bit of a built file: an accidental open for writing fails, and the file
    (perhaps a hard link shared by several versions) can only be replaced. A file we may not
    chmod (another owner's) is left as it is."""
    try:
        mode = os.stat(path).st_mode
        if mode & 0o222:
            os.chmod(path, stat.S_IMODE(mode) & ~0o222)
    except PermissionError:
        pass


def reuse_file(src: Path, dst: Path) -> str:
    """Give dst (a new name in a staging directory) src's bytes without copying them where the
    filesystem allows: a reflink (its own inode), else a hard link (the same inode, shared: safe
    because no built file is ever written again, see make_read_only), else a copy. Returns which."""
    fd = clone_file(src, dst)
    if fd is not None:
        try:
            os.fchmod(fd, READ_ONLY)
        finally:
            os.close(fd)
        return "reflink"
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        make_read_only(dst)
        return "copy"
    make_read_only(dst)
    return "link"


def check_base(index: DeltaIndex, view: CheckpointView, base_version: int) -> None:
    """Refuse (WrongBase/VersionGap) unless view holds exactly the delta's base."""
    if base_version < index.base_version:
        raise VersionGap(
            f"target is at version {base_version} but the delta needs base {index.base_version}: "
            f"versions {base_version + 1}..{index.base_version} are missing"
        )
    if base_version != index.base_version:
        raise WrongBase(f"target is at version {base_version}, the delta's base is {index.base_version}")
    if view.weight_map != index.weight_map:
        raise WrongBase("the target's weight map differs from the delta's (another model or shard layout)")
    for name, t in index.tensors.items():
        slot = view.slots[name]
        if slot.dtype != t.dtype or slot.shape != t.shape or slot.end - slot.start != t.nbytes:
            raise WrongBase(
                f"tensor {name!r} is {slot.dtype}{slot.shape} in the target, {t.dtype}{t.shape} in the delta"
            )


def _recorded_sums(marker: WeightsMarker | None, index: DeltaIndex) -> dict[str, str] | None:
    """The base's checksums as its marker records them (checked when that version was built)
    when they use the delta's algorithm and name the delta's tensors; else None."""
    if marker is None or marker.checksum != index.checksum or set(marker.checksums) != set(index.tensors):
        return None
    return marker.checksums


def _check_base_bytes(
    view: CheckpointView, index: DeltaIndex, names: list[str], pool: ThreadPoolExecutor
) -> None:
    """Refuse (WrongBase) unless the base's bytes of `names` hash to the delta's base checksums."""
    digest = checksum_fn(index.checksum)
    sums = dict(pool.map(lambda n: (n, digest(view.bytes_of(n))), names))
    for name in names:
        if sums[name] != index.tensors[name].base_checksum:
            raise WrongBase(f"tensor {name!r} in the target does not match the delta's base checksum")


def apply_delta(
    base_dir: Path,
    base_version: int,
    delta_dir: Path,
    out_dir: Path,
    *,
    threads: int = 0,
    index: DeltaIndex | None = None,
) -> WeightsMarker:
    """Build the delta's result in out_dir (existing, empty) from base_dir; verify it.

    base_dir is only read, and nothing outside out_dir is written. On any refusal an exception
    derived from DeltaRefused is raised and out_dir may hold partial files that the caller discards.

    The cost follows what changed: files without a changed tensor are reused (reuse_file) and
    their tensors checked through the base's marker, whose checksums must be the delta's base
    checksums (a base of other bytes is refused before anything is written); every tensor of a
    written shard is hashed back from the new file. Without a usable marker the base's changed
    tensors are hashed first and every tensor of the result after, as a full check.
    """
    delta_dir = Path(delta_dir)
    index = index or read_index(delta_dir)
    check_frames(delta_dir, index)
    changed = index.changed()
    for name, t in index.tensors.items():
        if not t.frames and t.checksum != t.base_checksum:
            raise ChecksumMismatch(
                f"{delta_dir}: tensor {name!r} has no frames, yet its recorded result checksum "
                f"{t.checksum} is not its base checksum {t.base_checksum}"
            )
    with open_checkpoint(base_dir) as view, ThreadPoolExecutor(resolve_threads(threads)) as pool:
        check_base(index, view, base_version)
        base_marker = read_marker(base_dir)
        try:
            check_layout(base_dir, view.slots, base_marker.layout if base_marker else {})
        except CheckpointError as exc:
            raise WrongBase(str(exc)) from exc
        layout = dict(view.slots)  # the result's headers are the base's bytes, copied
        recorded = _recorded_sums(base_marker, index)
        if recorded is None:
            # The base bytes of changed tensors must be exactly the base's: XOR on other bytes is garbage.
            _check_base_bytes(view, index, changed, pool)
        else:
            for name in sorted(index.tensors):
                if recorded[name] != index.tensors[name].base_checksum:
                    raise WrongBase(f"tensor {name!r} in the target does not match the delta's base checksum")
        changed_shards = sorted({index.tensors[n].shard for n in changed})
        for entry in sorted(base_dir.iterdir()):
            if entry.name == MARKER_NAME or not entry.is_file() or entry.name in changed_shards:
                continue
            reuse_file(entry, out_dir / entry.name)
        with _ShardWriter(view, delta_dir, out_dir) as writer:
            plan: list[_Write] = []
            for shard in changed_shards:
                size = view.shard_bytes(shard).size
                base = contained(base_dir, shard, entry="delta weight_map shard", error=CorruptDelta)
                cloned = writer.open_shard(shard, size, base)
                plan += _plan_shard(shard, size, view, index, FRAME_BYTES, gaps=not cloned)
            writer.run(plan, pool)
        written = sorted(n for n, t in index.tensors.items() if t.shard in changed_shards)
        try:
            new_sums = verify_tensors(
                out_dir, index, pool_threads=threads, layout=layout,
                names=written if recorded is not None else None,
            )  # fmt: skip
        except ChecksumMismatch:
            if recorded is not None:
                # Bytes damaged since the base was built, or a bad delta: only now read the base.
                _check_base_bytes(view, index, changed, pool)
            raise
    sums = dict(recorded or {}) | new_sums
    marker = WeightsMarker(version=index.version, checksum=index.checksum, checksums=sums, layout=layout)
    (out_dir / MARKER_NAME).write_bytes(msgspec.json.format(msgspec.json.encode(marker)))
    return marker


def verify_tensors(
    ckpt: Path,
    index: DeltaIndex,
    pool_threads: int = 0,
    layout: dict[str, TensorSlot] | None = None,
    names: list[str] | None = None,
) -> dict[str, str]:
    """Checksum the tensors of ckpt (`names`, default all) against the index (and its headers
    against `layout` when given); raise ChecksumMismatch on the first wrong one."""
    digest = checksum_fn(index.checksum)
    todo = sorted(index.tensors) if names is None else sorted(names)
    with open_checkpoint(ckpt) as view, ThreadPoolExecutor(resolve_threads(pool_threads)) as pool:
        if set(view.slots) != set(index.tensors):
            raise ChecksumMismatch(f"{ckpt}: tensor names differ from the delta's")
        try:
            check_layout(ckpt, view.slots, layout or {})
        except CheckpointError as exc:
            raise ChecksumMismatch(str(exc)) from exc
        got = dict(pool.map(lambda n: (n, digest(view.bytes_of(n))), todo))
    for name in todo:
        if got[name] != index.tensors[name].checksum:
            raise ChecksumMismatch(
                f"{ckpt}: tensor {name!r} checksum {got[name]} != recorded {index.tensors[name].checksum}"
            )
    return got


def diff_checkpoints(
    base_dir: Path,
    new_dir: Path,
    out_dir: Path,
    *,
    base_version: int,
    version: int,
    encoding: str = "xor",
    checksum: str = "xxh3-128",
    threads: int = 0,
) -> DeltaIndex:
    """The delta between two checkpoint directories with the same layout, into out_dir (staging)."""
    with open_checkpoint(base_dir) as bview, open_checkpoint(new_dir) as nview:
        if bview.weight_map != nview.weight_map:
            raise CheckpointError(
                f"{base_dir} and {new_dir} have different weight maps; deltas need one shard layout"
            )
        return encode_delta(
            checkpoint_tensors(bview),
            checkpoint_tensors(nview),
            out_dir,
            version=version,
            base_version=base_version,
            weight_map=nview.weight_map,
            encoding=encoding,
            checksum=checksum,
            threads=threads,
        )


__all__ = [
    "ChecksumMismatch",
    "CorruptDelta",
    "DeltaFormatError",
    "DeltaRefused",
    "RawTensor",
    "VersionGap",
    "WrongBase",
    "apply_delta",
    "clone_file",
    "diff_checkpoints",
    "encode_delta",
    "make_read_only",
    "preallocate",
    "reuse_file",
    "verify_delta",
    "verify_tensors",
]

"""Batches of Samples on the wire, two ways.

Columnar (`encode_batch` / `decode_batch`): per-token data — the bulk of a batch — travels as
a handful of flat arrays (tokens int32 concatenated with int64 offsets, masks uint8, log-probs
float32) that ZeroMQ sends as raw frames without copying; everything else rides in a msgpack
header, itself a uint8 frame. Log-probs travel as float32, the precision engines produce them
in. For receivers that want arrays (a trainer); building the arrays from Samples' Python lists
is the cost of this form.

Whole Samples (`pack_samples` / `SampleBatch`): the Samples as msgpack (the form the debug
dumps keep), in one uint8 frame, so bulk is sealed by its xxh3 digest rather than the
envelope's MAC. msgspec writes Python lists at C speed, so packing costs a fraction of
building arrays; the receiver decodes each Sample's scalar fields at once and leaves the
per-token lists (`LAZY_FIELDS`) as msgpack until that Sample is asked for, when it gets a
plain `Sample` with plain lists, as slime hooks expect. A receiver that reads only rewards,
statuses and lengths never pays for rebuilding lists.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec
import numpy as np

from tether.rollout.sample import Sample, SampleStatus

CODEC_VERSION = 1
FRAME_NAMES = ("tokens", "token_offsets", "mask_lengths", "loss_masks", "logprob_lengths", "log_probs")
_DTYPES: dict[str, np.dtype[Any]] = {
    "tokens": np.dtype("<i4"),
    "token_offsets": np.dtype("<i8"),
    "mask_lengths": np.dtype("<i8"),
    "loss_masks": np.dtype("u1"),
    "logprob_lengths": np.dtype("<i8"),
    "log_probs": np.dtype("<f4"),
}
_ABSENT = -1  # a length of -1 marks a None list (e.g. a pending sample without a mask yet)


class SampleCodecError(ValueError):
    """A batch's frames are malformed or truncated; the message says which frame and why."""


class SampleMeta(msgspec.Struct, array_like=True):
    """Everything of one Sample except its per-token arrays."""

    index: int | None
    group_index: int | None
    rollout_id: int | None
    prompt: str | list[dict[str, Any]]
    response: str
    response_length: int
    label: Any
    reward: float | dict[str, Any] | None
    status: SampleStatus
    weight_versions: list[str]
    metadata: dict[str, Any]
    session_id: str | None


class BatchHeader(msgspec.Struct):
    version: int
    count: int
    samples: list[SampleMeta]


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(BatchHeader)


def _lengths(values: Sequence[Sequence[Any] | None]) -> np.ndarray:
    return np.fromiter((_ABSENT if v is None else len(v) for v in values), dtype=np.int64, count=len(values))


def _concat(values: Sequence[Sequence[Any] | None], dtype: np.dtype) -> np.ndarray:
    flat = [x for v in values if v is not None for x in v]
    return np.asarray(flat, dtype=dtype)


def encode_batch(samples: Sequence[Sample]) -> list[np.ndarray]:
    """Frames for `samples`: the msgpack header first, then the arrays named in FRAME_NAMES."""
    metas = [
        SampleMeta(
            s.index,
            s.group_index,
            s.rollout_id,
            s.prompt,
            s.response,
            s.response_length,
            s.label,
            s.reward,
            SampleStatus(s.status),
            s.weight_versions,
            s.metadata,
            s.session_id,
        )
        for s in samples
    ]
    # The header goes as a uint8 array frame too: bulk frames are sealed by their xxh3 digests,
    # while bytes inside the envelope would go through the HMAC's SHA-256 (~10x slower).
    header = np.frombuffer(_encoder.encode(BatchHeader(CODEC_VERSION, len(samples), metas)), dtype=np.uint8)
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    masks = [s.loss_mask for s in samples]
    logps = [s.rollout_log_probs for s in samples]
    arrays = {
        "tokens": _concat([s.tokens for s in samples], _DTYPES["tokens"]),
        "token_offsets": offsets,
        "mask_lengths": _lengths(masks),
        "loss_masks": _concat(masks, _DTYPES["loss_masks"]),
        "logprob_lengths": _lengths(logps),
        "log_probs": _concat(logps, _DTYPES["log_probs"]),
    }
    return [header, *(arrays[name] for name in FRAME_NAMES)]


def _as_array(name: str, frame: Any) -> np.ndarray:
    dtype = _DTYPES[name]
    if isinstance(frame, np.ndarray):
        if frame.dtype != dtype or frame.ndim != 1:
            raise SampleCodecError(
                f"frame {name!r} has dtype {frame.dtype} and {frame.ndim} dims; expected 1-D {dtype}"
            )
        return frame
    buf = memoryview(frame).cast("B")
    if buf.nbytes % dtype.itemsize:
        raise SampleCodecError(
            f"frame {name!r} holds {buf.nbytes} bytes, not a multiple of {dtype.itemsize} ({dtype})"
        )
    return np.frombuffer(buf, dtype=dtype)


def _split(name: str, flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray | None]:
    present = lengths[lengths != _ABSENT]
    if (present < 0).any():
        raise SampleCodecError(f"frame {name!r}: negative length {int(present.min())}")
    if int(present.sum()) != flat.size:
        raise SampleCodecError(
            f"frame {name!r} holds {flat.size} values; the lengths add up to {int(present.sum())}"
        )
    out: list[np.ndarray | None] = []
    pos = 0
    for n in lengths.tolist():
        if n == _ABSENT:
            out.append(None)
        else:
            out.append(flat[pos : pos + n])
            pos += n
    return out


def decode_batch(frames: Sequence[Any]) -> list[Sample]:
    """Samples from frames made by encode_batch; raises SampleCodecError on any inconsistency."""
    if len(frames) != 1 + len(FRAME_NAMES):
        raise SampleCodecError(f"a sample batch has {1 + len(FRAME_NAMES)} frames, got {len(frames)}")
    try:
        header = _header_decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SampleCodecError(f"frame 'header' is not a valid batch header: {exc}") from exc
    if header.version != CODEC_VERSION:
        raise SampleCodecError(f"header version={header.version} is not supported (expected {CODEC_VERSION})")
    n = header.count
    if n != len(header.samples):
        raise SampleCodecError(f"header count={n} but it describes {len(header.samples)} samples")
    arr = {name: _as_array(name, f) for name, f in zip(FRAME_NAMES, frames[1:], strict=True)}
    offsets = arr["token_offsets"]
    if offsets.size != n + 1 or (n >= 0 and offsets.size and offsets[0] != 0):
        raise SampleCodecError(
            f"frame 'token_offsets' has {offsets.size} entries; expected {n + 1} starting at 0"
        )
    if (np.diff(offsets) < 0).any() or int(offsets[-1]) != arr["tokens"].size:
        raise SampleCodecError(
            f"frame 'token_offsets' does not describe frame 'tokens' ({arr['tokens'].size} tokens, last offset {int(offsets[-1])})"
        )
    for name in ("mask_lengths", "logprob_lengths"):
        if arr[name].size != n:
            raise SampleCodecError(f"frame {name!r} has {arr[name].size} entries; expected {n}")
    masks = _split("loss_masks", arr["loss_masks"], arr["mask_lengths"])
    logps = _split("log_probs", arr["log_probs"], arr["logprob_lengths"])
    tokens = arr["tokens"].tolist()
    bounds = offsets.tolist()
    samples = []
    for i, meta in enumerate(header.samples):
        mask, logp = masks[i], logps[i]
        samples.append(
            Sample(
                index=meta.index,
                group_index=meta.group_index,
                rollout_id=meta.rollout_id,
                prompt=meta.prompt,
                tokens=tokens[bounds[i] : bounds[i + 1]],
                response=meta.response,
                response_length=meta.response_length,
                label=meta.label,
                reward=meta.reward,
                loss_mask=None if mask is None else mask.tolist(),
                rollout_log_probs=None if logp is None else logp.tolist(),
                status=meta.status,
                weight_versions=meta.weight_versions,
                metadata=meta.metadata,
                session_id=meta.session_id,
            )
        )
    return samples


# -- whole Samples ---------------------------------------------------------------------------
WHOLE_VERSION = 1
LAZY_FIELDS = ("tokens", "loss_mask", "rollout_log_probs", "teacher_log_probs", "rollout_routed_experts")
"""The per-token fields of a Sample, left as msgpack in a received batch until asked for."""
_FIELDS = msgspec.structs.fields(Sample)
_SCALAR_FIELDS = tuple(f.name for f in _FIELDS if f.name not in LAZY_FIELDS)
_scalars_of = operator.itemgetter(*(i for i, f in enumerate(_FIELDS) if f.name not in LAZY_FIELDS))
_lazy_of = operator.itemgetter(*([f.name for f in _FIELDS].index(name) for name in LAZY_FIELDS))
_LAZY_TYPES = {f.name: f.type for f in _FIELDS if f.name in LAZY_FIELDS}
_lazy_decoder = msgspec.msgpack.Decoder(tuple[tuple(_LAZY_TYPES[name] for name in LAZY_FIELDS)])  # type: ignore[misc]
_AT_INDEX = re.compile(r"\$\[(\d+)\]")


def _head_type() -> Any:
    """`Sample`'s scalar fields in order (built from `Sample`, so a field added there travels
    without a change here), then `per_token`: the msgpack encoding of the per-token fields
    (`LAZY_FIELDS`, in that order). Each Sample goes as an array of them, `per_token` as a
    msgpack bin, which a reader skips in one step where a list must be walked value by value."""
    fields = [(f.name, f.type) for f in _FIELDS if f.name not in LAZY_FIELDS]
    # gc=False: the heads of a batch are made hundreds at a time, and as tracked objects each
    # batch set off collections that walked them (512 heads decoded in 0.91 ms with, 0.26 ms
    # without). A head refers to no head: it cannot be part of a cycle of its own.
    return msgspec.defstruct(
        "SampleHead", [*fields, ("per_token", memoryview)], array_like=True, gc=False, module=__name__
    )


def _per_token_size(sample: Sample) -> int:
    """Room for the msgpack of `sample`'s per-token fields (an int token takes at most 5 bytes
    below 2**32, a float 9); a Sample outside these bounds only costs the buffer a regrowth."""
    floats = len(sample.rollout_log_probs or ()) + len(sample.teacher_log_probs or ())
    routed = sample.rollout_routed_experts
    return (
        64
        + 5 * len(sample.tokens)
        + 2 * len(sample.loss_mask or ())
        + 9 * floats
        + (len(routed.data) if routed else 0)
    )


SampleHead = _head_type()
"""A received Sample's scalar fields under `Sample`'s names; its per-token fields still msgpack."""
_whole_decoder = msgspec.msgpack.Decoder(tuple[int, list[SampleHead]])  # type: ignore[valid-type]


def pack_samples(samples: Sequence[Sample]) -> np.ndarray:
    """Whole Samples as one uint8 frame (msgpack), for `SampleBatch` on the other side."""
    encode_into = _encoder.encode_into
    rows = []
    for sample in samples:
        values = msgspec.structs.astuple(sample)
        # Into a buffer sized for it up front: the encoder's own buffer would grow from empty.
        per_token = bytearray(_per_token_size(sample))
        encode_into(_lazy_of(values), per_token)
        rows.append((*_scalars_of(values), per_token))
    return np.frombuffer(_encoder.encode((WHOLE_VERSION, rows)), dtype=np.uint8)


class SampleBatch(Sequence[Sample]):
    """The Samples of a frame made by `pack_samples`, each built on first access.

    `heads[i]` holds Sample i's scalar fields (index, reward, status, response_length, ...)
    decoded; `batch[i]` is the full `Sample`, its per-token lists decoded then and kept.
    Raises SampleCodecError for a frame that is not such a batch, or a Sample whose
    per-token fields do not decode (naming the field and the sample). The heads hold views of
    `frame`, which stays alive as long as they do.
    """

    __slots__ = ("_samples", "heads")

    def __init__(self, frame: Any) -> None:
        try:
            version, heads = _whole_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SampleCodecError(f"frame is not a whole-Sample batch: {exc}") from exc
        if version != WHOLE_VERSION:
            raise SampleCodecError(
                f"whole-Sample batch version={version} is not supported (expected {WHOLE_VERSION})"
            )
        self.heads: list[Any] = heads
        self._samples: list[Sample | None] = [None] * len(heads)

    def __len__(self) -> int:
        return len(self.heads)

    @overload
    def __getitem__(self, i: int) -> Sample: ...
    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...
    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.heads)))]
        sample = self._samples[i]
        if sample is None:
            sample = self._samples[i] = _materialize(self.heads[i], i)
        return sample

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self.heads)):
            yield self[i]


def _materialize(head: Any, position: int) -> Sample:
    values = msgspec.structs.astuple(head)
    try:
        lazy = _lazy_decoder.decode(values[-1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        at = _AT_INDEX.search(str(exc))
        what = (
            f"field {LAZY_FIELDS[int(at.group(1))]!r}"
            if at and int(at.group(1)) < len(LAZY_FIELDS)
            else "per-token fields"
        )
        raise SampleCodecError(f"sample {position} (index {head.index}): {what}: {exc}") from exc
    return Sample(
        **dict(zip(_SCALAR_FIELDS, values, strict=False)), **dict(zip(LAZY_FIELDS, lazy, strict=True))
    )

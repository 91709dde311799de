"""The Sample batch codecs (columnar frames; whole Samples decoded lazily) round-trip any batch
and reject malformed frames cleanly."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.bench.runtime.sample_codec import (
    LAZY_FIELDS,
    WHOLE_VERSION,
    SampleBatch,
    SampleCodecError,
    decode_batch,
    encode_batch,
    pack_samples,
)
from tether.rollout.sample import RoutedExperts, Sample

f32 = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
text = st.text(max_size=20)
json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3),
    max_leaves=8,
)
chat = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    max_size=3,
)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), max_size=40))
    n = draw(st.integers(0, len(tokens)))
    with_arrays = draw(st.booleans())
    return Sample(
        index=draw(st.none() | st.integers(0, 10**6)),
        group_index=draw(st.none() | st.integers(0, 10**6)),
        rollout_id=draw(st.none() | st.integers(0, 10**6)),
        prompt=draw(text | chat),
        tokens=tokens,
        response=draw(text),
        response_length=n,
        label=draw(json_value),
        reward=draw(
            st.none()
            | st.floats(allow_nan=False)
            | st.dictionaries(text, st.floats(allow_nan=False), max_size=3)
        ),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) if with_arrays else None,
        rollout_log_probs=draw(st.lists(f32, min_size=n, max_size=n)) if with_arrays else None,
        status=draw(st.sampled_from(list(Sample.Status))),
        weight_versions=draw(st.lists(st.integers(0, 99).map(str), max_size=3)),
        metadata=draw(st.dictionaries(text, json_value, max_size=3)),
        session_id=draw(st.none() | text),
    )


def _wire(frames: list[bytes | np.ndarray]) -> list[bytes]:
    """What arrives after a trip through ZeroMQ: plain bytes per frame."""
    return [bytes(memoryview(f)) for f in frames]


@settings(max_examples=150, deadline=None)
@given(st.lists(samples(), max_size=8))
def test_round_trip_equals(batch: list[Sample]) -> None:
    assert decode_batch(_wire(encode_batch(batch))) == batch
    assert decode_batch(encode_batch(batch)) == batch  # in-process, arrays passed as they are


def test_empty_batch() -> None:
    assert decode_batch(_wire(encode_batch([]))) == []


def test_frames_are_columnar() -> None:
    batch = [
        Sample(
            tokens=list(range(1024)),
            response_length=1000,
            loss_mask=[1] * 1000,
            rollout_log_probs=[-0.5] * 1000,
        )
    ] * 3
    frames = encode_batch(batch)
    assert len(frames[0]) < 400  # the header holds no per-token data
    assert frames[1].dtype == np.int32 and frames[1].size == 3 * 1024
    assert frames[4].dtype == np.uint8 and frames[6].dtype == np.float32


def _good_frames() -> list[bytes]:
    s = Sample(
        rollout_id=1, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -2.0]
    )
    return _wire(encode_batch([s, s]))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f[:-1], "7 frames"),
        (lambda f: [b"\xc1garbage", *f[1:]], "header"),
        (lambda f: [f[0][:-3], *f[1:]], "header"),
        (lambda f: [f[0], f[1][:-1], *f[2:]], "'tokens'"),
        (lambda f: [f[0], f[1][:-4], *f[2:]], "'token_offsets'"),
        (lambda f: [f[0], f[1], f[2][:8], *f[3:]], "'token_offsets'"),
        (lambda f: [*f[:4], f[4][:-1], *f[5:]], "'loss_masks'"),
        (lambda f: [*f[:6], f[6] + b"\0\0\0\0"], "'log_probs'"),
        (lambda f: [*f[:3], np.array([-5, 2], np.int64).tobytes(), *f[4:]], "negative length"),
        (
            lambda f: [msgspec.msgpack.encode({"version": 99, "count": 0, "samples": []}), *f[1:]],
            "version=99",
        ),
    ],
)
def test_malformed_frames_raise_clear_errors(mutate: object, message: str) -> None:
    frames = mutate(_good_frames())  # type: ignore[operator]
    with pytest.raises(SampleCodecError, match=message.replace("[", r"\[")):
        decode_batch(frames)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_corruption_never_escapes_as_another_error(data: st.DataObject) -> None:
    frames = _good_frames()
    i = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[i])
    if raw:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    frames[i] = bytes(raw[:cut])
    try:
        decoded = decode_batch(frames)
    except SampleCodecError:
        return
    assert len(decoded) == 2 or isinstance(decoded, list)


# -- whole Samples ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(samples(), max_size=8))
def test_whole_samples_round_trip_equal(batch: list[Sample]) -> None:
    frame = pack_samples(batch)
    for received in (frame, bytes(frame)):  # in-process, and as bytes off the wire
        got = SampleBatch(received)
        assert len(got) == len(batch)
        assert [h.reward for h in got.heads] == [s.reward for s in batch]
        assert [h.response_length for h in got.heads] == [s.response_length for s in batch]
        assert list(got) == batch
        assert all(type(s.tokens) is list for s in got)  # plain lists, as slime hooks expect


def test_whole_samples_carry_every_field_and_build_each_sample_once() -> None:
    sample = Sample(
        index=3,
        rollout_id=1,
        tokens=[5, 6, 7, 8],
        response_length=2,
        loss_mask=[1, 0],
        rollout_log_probs=[-0.5, 0.0],
        teacher_log_probs=[-0.25, -1.0],
        rollout_routed_experts=RoutedExperts.from_array(np.arange(18).reshape(3, 2, 3)),
        metadata={"k": [1, 2]},
    )
    batch = SampleBatch(bytes(pack_samples([sample, Sample()])))
    assert set(LAZY_FIELDS) <= {f.name for f in msgspec.structs.fields(Sample)}
    # Scalars are there at once, under Sample's names; per-token fields are still msgpack.
    assert (batch.heads[0].index, batch.heads[0].metadata) == (3, {"k": [1, 2]})
    assert isinstance(batch.heads[0].per_token, memoryview) and not hasattr(batch.heads[0], "tokens")
    assert batch._samples == [None, None]
    first = batch[0]
    assert first == sample and batch._samples[1] is None  # only the Sample asked for is built
    assert batch[0] is first and batch[-1] == Sample() and batch[0:1] == [sample]


def test_malformed_whole_sample_frames_raise_clear_errors() -> None:
    good = bytes(pack_samples([Sample(tokens=[1, 2], response_length=1)]))
    with pytest.raises(SampleCodecError, match="not a whole-Sample batch"):
        SampleBatch(good[:-3])
    with pytest.raises(SampleCodecError, match="version=99"):
        SampleBatch(msgspec.msgpack.encode((99, [])))
    # A per-token field that is not what Sample holds fails when that Sample is built, naming it.
    row = list(msgspec.msgpack.decode(good)[1][0])
    row[-1] = msgspec.msgpack.encode((["x"], None, None, None, None))  # LAZY_FIELDS, tokens first
    batch = SampleBatch(msgspec.msgpack.encode((WHOLE_VERSION, [row])))
    assert batch.heads[0].response_length == 1
    with pytest.raises(SampleCodecError, match=r"sample 0 \(index None\): field 'tokens'"):
        batch[0]

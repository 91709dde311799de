"""The wire's compact form: a small message without arrays goes as one frame `envelope | seal`,
sealed by keyed BLAKE2b exactly as the separate seal frame would be; receivers take both."""

from __future__ import annotations

import numpy as np

from tether.runtime.rpc import wire
from tether.runtime.rpc.secret import new_secret
from tether.runtime.rpc.wire import Codec, Direction, Kind

TAG = bytes(range(16))


def _sealed(codec: Codec, body: object, seq: int = 7) -> list[object]:
    return codec.seal(codec.prepare(Kind.CALL, 5, "add", body), Direction.CALL, TAG, seq)


def test_small_message_without_arrays_is_one_frame_that_opens() -> None:
    codec = Codec(new_secret())
    frames = _sealed(codec, ((1, 2), {}))
    assert len(frames) == 1
    whole = memoryview(frames[0])  # type: ignore[arg-type]
    opened = codec.open_compact(whole)
    assert opened is not None
    env, header = opened
    assert (env.kind, env.id, env.method) == (Kind.CALL, 5, "add")
    assert header == (Direction.CALL, TAG, 7)
    assert codec.decode(env.body, (), object) == [[1, 2], {}]
    # The same bytes split in two are the separate form, which every receiver also takes.
    split = wire.split_compact(frames)
    assert split is not None and codec.verify(split) and codec.verify(frames)
    assert codec.open(frames).method == "add" and codec.open(split).method == "add"


def test_compact_seal_equals_the_separate_seal() -> None:
    codec = Codec(new_secret())
    frames = _sealed(codec, None, seq=3)
    separate = codec.encode(Kind.CALL, 5, "add", None, session=TAG, seq=3)
    assert len(separate) == 2
    assert bytes(frames[0]) == bytes(separate[0]) + bytes(separate[1])  # type: ignore[arg-type]


def test_tampered_foreign_and_misshapen_compact_frames_are_refused() -> None:
    codec = Codec(new_secret())
    good = bytes(_sealed(codec, ((1, 2), {}))[0])  # type: ignore[arg-type]
    for i in (0, len(good) // 2, len(good) - 1):  # envelope, header or mac changed
        bad = bytearray(good)
        bad[i] ^= 1
        assert codec.open_compact(memoryview(bytes(bad))) is None
    assert Codec(new_secret()).open_compact(memoryview(good)) is None  # another run's secret
    assert codec.open_compact(memoryview(good[: wire.COMPACT_SEAL_BYTES])) is None  # no envelope
    assert wire.split_compact([good[: wire.COMPACT_SEAL_BYTES]]) is None
    # A frame whose envelope would be large is refused before anything is hashed.
    huge = bytes(wire.LARGE_ENVELOPE_BYTES + 1 + wire.COMPACT_SEAL_BYTES)
    assert codec.open_compact(memoryview(huge)) is None


def test_arrays_large_and_big_envelopes_keep_the_separate_seal() -> None:
    codec = Codec(new_secret())
    with_array = _sealed(codec, ((np.arange(4),), {}))
    assert len(with_array) == 3  # envelope, array, seal
    big = _sealed(codec, ((b"x" * (wire.COMPACT_MAX_ENVELOPE + 1),), {}))
    assert len(big) == 2 and codec.verify(big)  # joining would copy the envelope

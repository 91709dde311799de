"""The RPC wire format: one msgpack envelope frame, raw array frames, and a seal frame.

A message is the ZeroMQ multipart `[envelope, array_1, ..., array_n, seal]`:

- `envelope` is msgpack `[kind, call_id, method, body]`; `body` may hold numpy arrays, each
  replaced by a msgpack Ext(`ARRAY_EXT`, [frame_index, dtype, shape]) that points into the
  array frames, so bulk data is never copied into the msgpack buffer.
- `seal` is the xxh3-128 digest of each array frame (16 bytes each, in order) followed by
  HMAC-SHA256 under the run secret over the envelope's length, the envelope and those digests.
  The receiver recomputes every digest and the HMAC and drops the message on any mismatch.

Threat model: the secret authenticates who sent a message (only processes of this run hold
it), and the envelope is authenticated in full; bulk integrity rests on the authenticated
xxh3-128 digests, which guard against accidents and stray peers (another run, a port scanner,
a truncated or corrupted frame), not against an attacker who can rewrite traffic in flight on
the cluster network (xxh3 is not collision-resistant). This keeps SHA-256 off the bulk bytes,
which it would otherwise bound at about 2 GB/s per side.

Arrays decode as views over the received ZeroMQ frames (no copy); they keep the frame
alive for as long as they live.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

if TYPE_CHECKING:
    import numpy as np

ARRAY_EXT = 1
MAC_BYTES = 32
DIGEST_BYTES = 16
_STREAM_MAC_BYTES = 1 << 16  # above this an envelope is fed to HMAC in place, not joined first
_digest = xxhash.xxh3_128_digest
_NIL = msgspec.Raw(b"\xc0")


class Kind(enum.IntEnum):
    CALL = 1
    RESULT = 2
    ERROR = 3
    CANCEL = 4
    PING = 5
    PONG = 6


class _EnvelopeOut(msgspec.Struct, array_like=True):
    kind: int
    id: int
    method: str
    body: Any


class Envelope(msgspec.Struct, array_like=True):
    """A decoded envelope; `body` stays raw until the receiver knows the type to decode it as."""

    kind: int
    id: int
    method: str
    body: msgspec.Raw = _NIL


class CallBody(msgspec.Struct, array_like=True):
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]


class ErrorBody(msgspec.Struct, array_like=True):
    type_name: str
    message: str
    traceback: str


class MalformedMessage(ValueError):
    """A message that authenticated but could not be decoded."""


def _dec_hook(type_: type, obj: Any) -> Any:
    # Arrays come out of ext_hook already built; msgspec only asks us to confirm the type.
    if isinstance(obj, type_):
        return obj
    raise TypeError(f"expected {type_.__name__}, got {type(obj).__name__}")


class Codec:
    """Encodes and decodes messages for one socket owner (not shared between threads).

    The array frames of the message being encoded/decoded live on the instance while msgspec
    runs its hooks, which is why one codec must not be used concurrently from two threads.
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"secret is too short: {len(secret)} bytes, need at least 16")
        self._key = secret
        self._hmac_proto = hmac.new(secret, digestmod=hashlib.sha256)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._out: list[np.ndarray] = []
        self._in: Sequence[Any] = ()
        self._envelope_decoder = msgspec.msgpack.Decoder(Envelope)
        self._call_decoder = msgspec.msgpack.Decoder(CallBody)
        self._error_decoder = msgspec.msgpack.Decoder(ErrorBody)
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
        self._ext_meta = msgspec.msgpack.Decoder(tuple[int, str, tuple[int, ...]])

    # -- authentication -------------------------------------------------------------------
    def _hmac(self, envelope: Any, digests: bytes) -> bytes:
        size = memoryview(envelope).nbytes
        prefix = size.to_bytes(8, "little")
        if size <= _STREAM_MAC_BYTES:
            return hmac.digest(self._key, b"".join((prefix, envelope, digests)), "sha256")
        h = self._hmac_proto.copy()
        h.update(prefix)
        h.update(envelope)
        h.update(digests)
        return h.digest()

    def mac(self, frames: Sequence[Any]) -> bytes:
        """The seal frame for `frames` (the envelope, then the array frames)."""
        digests = b"".join([_digest(f) for f in frames[1:]])
        return digests + self._hmac(frames[0], digests)

    def verify(self, frames: Sequence[Any]) -> bool:
        """True when the last frame is a valid seal over the others."""
        if len(frames) < 2:
            return False
        seal = memoryview(frames[-1])
        n_arrays = len(frames) - 2
        if seal.nbytes != n_arrays * DIGEST_BYTES + MAC_BYTES:
            return False
        digests = bytes(seal[: n_arrays * DIGEST_BYTES])
        # The HMAC first: a stranger's message is rejected without hashing its bulk.
        if not hmac.compare_digest(self._hmac(frames[0], digests), seal[n_arrays * DIGEST_BYTES :]):
            return False
        for i in range(n_arrays):
            if _digest(frames[i + 1]) != digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]:
                return False
        return True

    # -- encoding -------------------------------------------------------------------------
    def _enc_hook(self, obj: Any) -> Any:
        # numpy is imported on first use only (a process that never holds an array starts
        # faster); an object cannot be an array while numpy is not imported.
        np = sys.modules.get("numpy")
        if np is None:
            raise TypeError(f"cannot encode an object of type {type(obj).__qualname__} in an RPC message")
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.fields is not None:
                raise TypeError(f"numpy dtype {obj.dtype} cannot travel as a raw frame (plain dtypes only)")
            arr = np.ascontiguousarray(obj)
            self._out.append(arr)
            meta = msgspec.msgpack.encode((len(self._out), arr.dtype.str, arr.shape))
            return msgspec.msgpack.Ext(ARRAY_EXT, meta)
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot encode an object of type {type(obj).__qualname__} in an RPC message")

    def encode(self, kind: Kind, call_id: int, method: str, body: Any) -> list[Any]:
        """Frames (envelope, arrays..., mac) ready for `send_multipart(copy=False)`."""
        self._out = []
        try:
            envelope = self._encoder.encode(_EnvelopeOut(int(kind), call_id, method, body))
            frames: list[Any] = [envelope, *self._out]
        finally:
            self._out = []
        frames.append(self.mac(frames))
        return frames

    def encode_error(self, call_id: int, exc: BaseException, traceback_text: str) -> list[Any]:
        type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        if type(exc).__module__ == "builtins":
            type_name = type(exc).__qualname__
        return self.encode(Kind.ERROR, call_id, "", ErrorBody(type_name, str(exc), traceback_text))

    # -- decoding -------------------------------------------------------------------------
    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != ARRAY_EXT:
            raise MalformedMessage(f"unknown msgpack extension type {code}")
        import numpy as np

        index, dtype, shape = self._ext_meta.decode(data)
        if not 1 <= index < len(self._in) - 1:  # frame 0 is the envelope, the last the mac
            raise MalformedMessage(
                f"array frame index {index} out of range (message has {len(self._in)} frames)"
            )
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise MalformedMessage(f"bad array dtype {dtype!r}") from None
        if dt.hasobject:
            raise MalformedMessage(f"array dtype {dtype!r} holds Python objects")
        buf = self._in[index]
        count = 1
        for dim in shape:
            if dim < 0:
                raise MalformedMessage(f"negative array dimension in shape {shape}")
            count *= dim
        if count * dt.itemsize != memoryview(buf).nbytes:
            raise MalformedMessage(
                f"array frame {index} holds {memoryview(buf).nbytes} bytes, shape {shape} of {dt} needs "
                f"{count * dt.itemsize}"
            )
        return np.frombuffer(buf, dtype=dt).reshape(shape)

    def decoder(self, type_: Any) -> msgspec.msgpack.Decoder[Any]:
        """A (cached) decoder for `type_` that rebuilds arrays from this message's frames."""
        dec = self._decoders.get(type_)
        if dec is None:
            dec = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)
            self._decoders[type_] = dec
        return dec

    def open(self, frames: Sequence[Any]) -> Envelope:
        """Decode the envelope of an authenticated message; arrays resolve against `frames`.

        `frames` excludes the routing identity and includes the mac frame.
        """
        try:
            return self._envelope_decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(f"bad envelope: {exc}") from None

    def decode(self, raw: msgspec.Raw | bytes | memoryview, frames: Sequence[Any], type_: Any = Any) -> Any:
        """Decode `raw` (a body or part of one) as `type_`, resolving arrays against `frames`."""
        self._in = frames
        try:
            return self.decoder(type_).decode(raw)
        finally:
            self._in = ()

    def decode_call(self, raw: msgspec.Raw) -> CallBody:
        return self._call_decoder.decode(raw)

    def decode_error(self, raw: msgspec.Raw) -> ErrorBody:
        return self._error_decoder.decode(raw)

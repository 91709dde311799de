"""The RPC wire format: one msgpack envelope frame, raw array frames, and a seal frame.

A message is the ZeroMQ multipart `[envelope, array_1, ..., array_n, seal]`, or, when it has
no arrays and is not large, the single frame `envelope | seal` (the compact form: one frame
less to queue, send and receive, which is most of a small call's cost in ZeroMQ). A receiver
tells the forms apart by the number of frames (a separate seal needs two at least) and splits
the compact one (`split_compact`) before anything else.

- `envelope` is msgpack `[kind, call_id, method, body]`; `body` may hold numpy arrays, each
  replaced by a msgpack Ext(`ARRAY_EXT`, [frame_index, dtype, shape]) that points into the
  array frames, so bulk data is never copied into the msgpack buffer.
- `seal` is `header | head_mac | digests | mac`:
  - `header` (25 bytes): the direction (`Direction.CALL` caller to server, `Direction.REPLY`
    back), the session tag (16 bytes) and the message's sequence number in its session and
    direction (u64). A receiver takes each sequence number once, in increasing order, and only
    under the session tag of the connection it arrives on (`tether.runtime.rpc.actors`), so a
    captured message replayed on the same or another connection is dropped.
  - `digests`: the xxh3-128 digest of each array frame (16 bytes each, in order).
  - `mac`: keyed BLAKE2b-256 under a key derived from the run secret, over the header, the
    envelope's length, the envelope and the digests. BLAKE2b in keyed mode is a MAC by
    design (no HMAC construction needed) and costs a quarter of OpenSSL's HMAC-SHA256 at
    these sizes, where the MAC's set-up, not the bytes, is the price.
  - `head_mac`, only in a large message (`is_large`: about a millisecond of hashing or more):
    the MAC over the header and the frame sizes. A receiver checks it first, so a stranger's
    large message costs one small MAC, not a hash of its bulk; the mac of a large message
    covers the envelope's SHA-256 instead of the envelope, so that all hashing of a large
    message can run off the event loop and the seal itself is cheap.

Threat model: the secret authenticates who sent a message (only processes of this run hold
it), and the envelope is authenticated in full; bulk integrity rests on the authenticated
xxh3-128 digests, which guard against accidents and stray peers (another run, a port scanner,
a truncated or corrupted frame), not against an attacker who can rewrite traffic in flight on
the cluster network (xxh3 is not collision-resistant). This keeps SHA-256 off the bulk bytes,
which it would otherwise bound at about 2 GB/s per side. An attacker who can only record and
resend traffic gets nothing executed (see the header above).

Arrays decode as views over the received ZeroMQ frames (no copy); they keep the frame
alive for as long as they live.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

if TYPE_CHECKING:
    import numpy as np

ARRAY_EXT = 1
MAC_BYTES = 32
DIGEST_BYTES = 16
SESSION_BYTES = 16
NO_SESSION = bytes(SESSION_BYTES)
# A message is "large" when hashing it takes about a millisecond or more: its hashing then
# belongs off the event loop. SHA-256 (the envelope) runs at about 1 GB/s, xxh3 (the arrays)
# at about 15 GB/s.
LARGE_ENVELOPE_BYTES = 1 << 20
LARGE_ARRAY_BYTES = 16 << 20
_HEADER = struct.Struct("<B16sQ")  # direction, session tag, sequence number
HEADER_BYTES = _HEADER.size
_STREAM_MAC_BYTES = 1 << 16  # above this an envelope is fed to the MAC in place, not joined first
# A message without arrays goes as one frame up to this envelope size: joining copies the
# envelope, which costs less than a frame only while the envelope is small.
COMPACT_MAX_ENVELOPE = 1 << 16
COMPACT_SEAL_BYTES = HEADER_BYTES + MAC_BYTES  # the seal of a message without arrays, not large
_MAC_PERSON = b"tether-rpc-mac"  # BLAKE2b personalisation: this key is for nothing else
_HEAD_CONTEXT = b"tether-head\x00"
_SESSION_CONTEXT = b"tether-session\x00"
_digest = xxhash.xxh3_128_digest
_NIL = msgspec.Raw(b"\xc0")


class Kind(enum.IntEnum):
    CALL = 1
    RESULT = 2
    ERROR = 3
    CANCEL = 4
    PING = 5
    PONG = 6
    HELLO = 7  # opens a session: method is the server's name, the seal's session the caller's nonce
    WELCOME = 8  # answers HELLO: method is the server's name, body the server's nonce


class Direction(enum.IntEnum):
    CALL = 0x43  # caller to server ("C")
    REPLY = 0x52  # server to caller ("R")


CALLER_KINDS = frozenset({Kind.CALL, Kind.CANCEL, Kind.PING, Kind.HELLO})


def direction_of(kind: Kind) -> Direction:
    return Direction.CALL if kind in CALLER_KINDS else Direction.REPLY


SealHeader = tuple[int, bytes, int]  # direction, session tag, sequence number


def split_compact(frames: Sequence[Any]) -> list[Any] | None:
    """A message's frames with the compact form's single frame split into views of its
    envelope and its seal (other messages as they are); None when a single frame is too short
    to hold a seal."""
    if len(frames) != 1:
        return list(frames)
    whole = memoryview(frames[0])
    if whole.nbytes <= COMPACT_SEAL_BYTES:
        return None
    cut = whole.nbytes - COMPACT_SEAL_BYTES
    return [whole[:cut], whole[cut:]]


def read_header(seal: Any) -> SealHeader:
    """The header of a seal frame whose layout `Codec.verify` or `Codec.check_head` accepted."""
    return _HEADER.unpack_from(seal)  # type: ignore[return-value]


def _nbytes(buf: Any) -> int:
    return len(buf) if type(buf) is bytes else memoryview(buf).nbytes


def is_large(envelope_bytes: int, array_bytes: int) -> bool:
    """Whether a message of these sizes is large (hashed off the event loop, with a head mac)."""
    return envelope_bytes > LARGE_ENVELOPE_BYTES or array_bytes > LARGE_ARRAY_BYTES


def _is_large(frames: Sequence[Any]) -> bool:  # frames without the seal
    return is_large(_nbytes(frames[0]), sum(_nbytes(f) for f in frames[1:]))


@dataclass(slots=True)
class Outgoing:
    """An encoded message waiting for its seal: `frames` are the envelope, then the arrays.

    `hash()` computes what the seal needs from the bulk; it touches no codec state, so a large
    message hashes in a worker thread while the event loop goes on. Sealing is then cheap and
    happens when the message is sent, which is what orders its sequence number.
    """

    frames: list[Any]
    large: bool
    digests: bytes | None = None
    envelope_part: Any = None  # what the mac covers for the envelope: itself or its SHA-256

    def hash(self) -> None:
        if self.digests is None:
            self.digests = b"".join([_digest(f) for f in self.frames[1:]])
        if self.envelope_part is None:
            env = self.frames[0]
            self.envelope_part = hashlib.sha256(env).digest() if self.large else env


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
    runs its hooks, which is why one codec must not be used concurrently from two threads;
    `verify` of a large message and `check_head` are the exceptions (worker threads run them).
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(f"secret is too short: {len(secret)} bytes, need at least 16")
        # BLAKE2b takes keys up to 64 bytes: derive one of that size from a secret of any size.
        key = hashlib.blake2b(secret, digest_size=64, person=_MAC_PERSON).digest()
        # Keyed once: each MAC copies this state (half the cost of keying a new one).
        self._mac_proto = hashlib.blake2b(digest_size=MAC_BYTES, key=key)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._out: list[np.ndarray] = []
        self._in: Sequence[Any] = ()
        self._envelope_decoder = msgspec.msgpack.Decoder(Envelope)
        self._call_decoder = msgspec.msgpack.Decoder(CallBody)
        self._error_decoder = msgspec.msgpack.Decoder(ErrorBody)
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
        self._ext_meta = msgspec.msgpack.Decoder(tuple[int, str, tuple[int, ...]])

    # -- authentication -------------------------------------------------------------------
    # `verify` (of a large message), `check_head` and `Outgoing.hash` keep no state on the
    # codec, so a worker thread may run them while the event loop uses the codec.
    def _keyed(self, data: Any) -> bytes:
        h = self._mac_proto.copy()
        h.update(data)
        return h.digest()

    def _mac(self, header: Any, env_size: int, envelope_part: Any, digests: bytes, large: bool) -> bytes:
        prefix = env_size.to_bytes(8, "little")
        if large or env_size <= _STREAM_MAC_BYTES:  # a large message's part is a 32-byte digest
            return self._keyed(b"".join((header, prefix, envelope_part, digests)))
        h = self._mac_proto.copy()
        h.update(header)
        h.update(prefix)
        h.update(envelope_part)
        h.update(digests)
        return h.digest()

    def _head_mac(self, header: Any, frames: Sequence[Any]) -> bytes:
        sizes = struct.pack(f"<{len(frames)}Q", *[_nbytes(f) for f in frames])
        return self._keyed(b"".join((_HEAD_CONTEXT, header, sizes)))

    def session_tag(self, client_nonce: bytes, server_nonce: bytes, server_name: str) -> bytes:
        """The tag that every later message of a session carries: bound to both nonces and to
        the server's name, so it names one connection to one server."""
        data = b"".join((_SESSION_CONTEXT, client_nonce, server_nonce, server_name.encode()))
        return self._keyed(data)[:SESSION_BYTES]

    def _seal_frame(self, out: Outgoing, direction: int, session: bytes, seq: int) -> bytes:
        assert out.digests is not None, "Outgoing.hash() has not run"
        header = _HEADER.pack(direction, session, seq)
        mac = self._mac(header, _nbytes(out.frames[0]), out.envelope_part, out.digests, out.large)
        if out.large:
            return b"".join((header, self._head_mac(header, out.frames), out.digests, mac))
        return b"".join((header, out.digests, mac))

    def seal(self, out: Outgoing, direction: int, session: bytes, seq: int) -> list[Any]:
        """The frames that carry `out` (`out.hash()` must have run): its frames followed by
        their seal, or one frame `envelope | seal` (the compact form) for a small message
        without arrays."""
        frames = out.frames
        if len(frames) == 1 and not out.large:
            envelope = frames[0]
            size = len(envelope)
            if size <= COMPACT_MAX_ENVELOPE:
                header = _HEADER.pack(direction, session, seq)
                data = b"".join((header, size.to_bytes(8, "little"), envelope))
                h = self._mac_proto.copy()
                h.update(data)
                return [b"".join((envelope, header, h.digest()))]
        return [*frames, self._seal_frame(out, direction, session, seq)]

    def mac(
        self,
        frames: Sequence[Any],
        *,
        direction: int = Direction.CALL,
        session: bytes = NO_SESSION,
        seq: int = 0,
    ) -> bytes:
        """The seal frame for `frames` (the envelope, then the array frames)."""
        out = Outgoing(list(frames), _is_large(frames))
        out.hash()
        return self._seal_frame(out, direction, session, seq)

    def _layout(self, frames: Sequence[Any], large: bool | None) -> tuple[memoryview, int, bool] | None:
        """The seal, the number of array frames and whether the message is large, when the
        seal has the length that this many frames of these sizes need. `large`: `is_large`
        of the frames, when the caller has worked it out already."""
        n_arrays = len(frames) - 2
        if n_arrays < 0:
            return None
        seal = memoryview(frames[-1])
        if large is None:
            large = _is_large(frames[:-1])
        want = HEADER_BYTES + (MAC_BYTES if large else 0) + n_arrays * DIGEST_BYTES + MAC_BYTES
        if seal.nbytes != want:
            return None
        return seal, n_arrays, large

    def check_head(self, frames: Sequence[Any]) -> SealHeader | None:
        """The header of a large message when its head mac is valid (a cheap first check:
        sizes and header only), else None."""
        if len(frames) == 1:  # the compact form is never large
            return None
        layout = self._layout(frames, None)
        if layout is None or not layout[2]:
            return None
        seal = layout[0]
        head = seal[HEADER_BYTES : HEADER_BYTES + MAC_BYTES]
        if not hmac.compare_digest(self._head_mac(seal[:HEADER_BYTES], frames[:-1]), head):
            return None
        return read_header(seal)

    def open_compact(self, whole: memoryview) -> tuple[Envelope, SealHeader] | None:
        """The envelope and seal header of a message in the compact form (`whole`, its one
        frame) when its seal is valid, else None; MalformedMessage when it authenticates but
        its envelope does not decode. A frame too large for the compact form (its envelope
        would be large) is refused unhashed."""
        cut = whole.nbytes - COMPACT_SEAL_BYTES
        if cut <= 0 or cut > LARGE_ENVELOPE_BYTES:
            return None
        envelope = whole[:cut]
        header = whole[cut : cut + HEADER_BYTES]
        data = b"".join((header, cut.to_bytes(8, "little"), envelope))
        h = self._mac_proto.copy()
        h.update(data)
        if not hmac.compare_digest(h.digest(), whole[cut + HEADER_BYTES :]):
            return None
        try:
            env = self._envelope_decoder.decode(envelope)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(f"bad envelope: {exc}") from None
        return env, _HEADER.unpack_from(whole, cut)  # type: ignore[return-value]

    def verify(self, frames: Sequence[Any], large: bool | None = None) -> bool:
        """True when the last frame is a valid seal over the others (the whole check: in a
        worker thread for a large message). `large`: as for `_layout`. The compact form is
        taken as it arrives or split (`split_compact`)."""
        if len(frames) == 1:
            split = split_compact(frames)
            if split is None:
                return False
            frames = split
        layout = self._layout(frames, large)
        if layout is None:
            return False
        seal, n_arrays, large = layout
        header = seal[:HEADER_BYTES]
        offset = HEADER_BYTES
        if large:
            if not hmac.compare_digest(
                self._head_mac(header, frames[:-1]), seal[offset : offset + MAC_BYTES]
            ):
                return False
            offset += MAC_BYTES
        digests = bytes(seal[offset : offset + n_arrays * DIGEST_BYTES])
        env = frames[0]
        envelope_part = hashlib.sha256(env).digest() if large else env
        # The HMAC first: a stranger's message is rejected without hashing its bulk.
        mac = self._mac(header, _nbytes(env), envelope_part, digests, large)
        if not hmac.compare_digest(mac, seal[offset + n_arrays * DIGEST_BYTES :]):
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

    def prepare(self, kind: Kind, call_id: int, method: str, body: Any) -> Outgoing:
        """Encode a message; a small one is hashed at once, a large one by `Outgoing.hash`."""
        try:  # `_enc_hook` collects the arrays in `self._out`, empty between messages
            envelope = self._encoder.encode(_EnvelopeOut(int(kind), call_id, method, body))
        except BaseException:
            self._out = []
            raise
        if not self._out:  # no arrays: the common case, kept short
            if len(envelope) > LARGE_ENVELOPE_BYTES:
                return Outgoing([envelope], True)
            return Outgoing([envelope], False, b"", envelope)
        frames: list[Any] = [envelope, *self._out]
        self._out = []
        array_bytes = 0
        for arr in frames[1:]:
            array_bytes += arr.nbytes
        out = Outgoing(frames, is_large(len(envelope), array_bytes))
        if not out.large:
            out.hash()
        return out

    def encode(
        self,
        kind: Kind,
        call_id: int,
        method: str,
        body: Any,
        *,
        session: bytes = NO_SESSION,
        seq: int = 0,
    ) -> list[Any]:
        """Frames (envelope, arrays..., seal: always the separate seal, which every receiver
        takes) ready for `send_multipart(copy=False)`, sealed in one go (hashing included) in
        the direction that `kind` travels."""
        out = self.prepare(kind, call_id, method, body)
        out.hash()
        return [*out.frames, self._seal_frame(out, direction_of(kind), session, seq)]

    @staticmethod
    def error_body(exc: BaseException, traceback_text: str) -> ErrorBody:
        type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        if type(exc).__module__ == "builtins":
            type_name = type(exc).__qualname__
        return ErrorBody(type_name, str(exc), traceback_text)

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

        `frames` excludes the routing identity and includes the seal (or is the compact form).
        """
        envelope = frames[0]
        if len(frames) == 1:  # the compact form: the envelope without its seal
            envelope = memoryview(envelope)[:-COMPACT_SEAL_BYTES]
        try:
            return self._envelope_decoder.decode(envelope)
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

"""RPC over ZeroMQ: a ROUTER server that serves an object's async methods, DEALER handles.

    async with RpcServer(Counter(), "tcp://127.0.0.1:0", secret, name="counter") as server:
        async with await connect(server.address, secret, name="counter") as handle:
            await handle.add(3)                      # sugar for handle.call("add", 3)
            await handle.call("add", 3, timeout=1.0, result_type=int)

Every message is authenticated (see `tether.runtime.rpc.wire`). Sockets are read by the event
loop directly (`tether.runtime.rpc.loop_socket`), without a future per message. The server runs
each call in its own task, started in arrival order, so one caller's calls begin in the order
they were sent; many calls may be in flight. A caller that times out or is cancelled sends a CANCEL, which
cancels the remote task. Exceptions raised by a method are re-raised on the caller as
`RemoteError` with the remote type name, message and traceback text.

Sessions. A handle opens one on each connection (again after a reconnection): its HELLO
names the server it means and carries a random nonce, the server answers WELCOME with a nonce
of its own, and both derive the session tag (`Codec.session_tag`) that every later message's
seal carries, with a sequence number per direction. The server keeps the session of each
connection (ROUTER identity) and takes each sequence number once, in increasing order: a
message under another tag or with a number already passed is dropped and counted in
`dropped_replayed`, so a recorded CALL is never run twice, on its connection or another.
A HELLO that names another server is refused (`dropped_misdirected`) and the handle fails
with that reason.

Bounds on what a peer can make a process hold. ZeroMQ refuses a frame above
`max_message_bytes` as it arrives and drops that connection (MAXMSGSIZE) before buffering it;
it hands over a multipart message only once all its frames are in, and the total is checked
before anything is hashed. Queues are bounded by high-water marks: a caller's sends wait, in
order, while the server is not reading; a reply whose caller has `REPLY_HWM` replies unread is
dropped and counted (`dropped_replies`). Calls of one peer still running may hold
`max_inflight_bytes` of messages; more are refused with `RpcOverloaded`. The digests and HMAC
of a large message (`wire.is_large`) run in a worker thread while its socket is not read,
which keeps order and the event loop responsive; a stranger's large message fails its head
mac before any hashing. A connection that does not finish ZeroMQ's handshake within
`HANDSHAKE_IVL_MS` is closed, so idle connections cannot pile up and exhaust descriptors.

Names on the handle that clash with remote method names (`call`, `ping`, `close`, `name`,
`address`) are reached with `handle.call("close")`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dis
import functools
import inspect
import itertools
import logging
import secrets
import traceback
import typing
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tether.runtime.errors import ActorDied, RemoteError, RpcOverloaded, RpcTimeout
from tether.runtime.rpc.loop_socket import LoopSocket
from tether.runtime.rpc.wire import (
    COMPACT_SEAL_BYTES,
    SESSION_BYTES,
    Codec,
    Direction,
    Envelope,
    Kind,
    MalformedMessage,
    Outgoing,
    SealHeader,
    is_large,
    read_header,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
DEFAULT_MAX_INFLIGHT_BYTES = 2 << 30  # per peer: message bytes its running calls may hold
CALL_HWM = 1_000  # calls ZeroMQ queues per connection, on either side, before pushing back
# Replies: more room, as a ROUTER drops a reply it cannot queue (counted, never silent).
REPLY_HWM = 10_000
HANDSHAKE_IVL_MS = 2_000  # servers close connections still without a handshake by then
MAX_SESSIONS = 4_096  # sessions a server remembers (least recently used go first)
MAX_HALF_OPEN = 1_024  # sessions WELCOMEd but not yet used (a replayed HELLO only makes these)
_MONITOR_QUEUE = 64
_CALL = int(Direction.CALL)
_REPLY = int(Direction.REPLY)
_NO_FRAMES: tuple[Any, ...] = ()  # a message in the compact form has no array frames
# The body of a call whose method takes no Struct-typed argument, decoded in one go.
_PlainCall = tuple[list[Any], dict[str, Any]]


def _configure(sock: zmq.Socket[Any], max_message_bytes: int, *, sndhwm: int, rcvhwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Bounded queues (messages per connection): a peer that sends faster than we read is
    # pushed back through TCP instead of growing our memory.
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    # libzmq's own guard against a single frame beyond the limit: it refuses the frame and
    # closes that connection, before any memory is spent on it.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


def _open_compact(codec: Codec, whole: memoryview, max_bytes: int) -> tuple[Envelope, SealHeader] | str:
    """A compact (one-frame) message opened, or why it is dropped: "short" (no room for a seal),
    "oversized", "malformed" or "unauthenticated". Shared by the server's and the caller's side."""
    size = whole.nbytes
    if size <= COMPACT_SEAL_BYTES:
        return "short"
    if size > max_bytes:
        return "oversized"
    try:
        opened = codec.open_compact(whole)
    except MalformedMessage:
        return "malformed"
    return "unauthenticated" if opened is None else opened


def _log_drop(owner: str, what: str, count: int, peer: str) -> None:
    # Only at counts 1, 2, 4, 8, ...: a flood of bad messages cannot flood the log.
    if count & (count - 1) == 0:
        log.warning("%s dropped %s message from %s (%d so far)", owner, what, peer, count)


class RpcStats(msgspec.Struct, frozen=True):
    """An RPC server's counters (`RpcServer.stats()`)."""

    calls_served: int
    in_flight: int
    sessions: int
    dropped_unauthenticated: int
    dropped_malformed: int
    dropped_oversized: int
    dropped_replayed: int
    dropped_misdirected: int
    dropped_replies: int
    refused_overloaded: int


@dataclass(slots=True, eq=False)
class _Session:
    """One connection's session: its tag and the last sequence number each way."""

    tag: bytes
    recv_seq: int = 0
    send_seq: int = 0
    call_bytes: int = 0  # server side: bytes of this peer's calls still running


@dataclass(slots=True, eq=False)
class _Outbound:
    """A caller's message waiting for its turn, behind (or being) a large one still hashing."""

    out: Outgoing
    ready: bool
    dropped: bool = False


def _mentions_struct(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return True
    return any(_mentions_struct(arg) for arg in typing.get_args(hint))


# Opcodes at which a coroutine can suspend (await, async for, async with all compile to them).
_SUSPENDING_OPS = frozenset(
    {"YIELD_VALUE", "SEND", "GET_AWAITABLE", "GET_AITER", "GET_ANEXT", "BEFORE_ASYNC_WITH"}
)


def never_suspends(fn: Callable[..., Any]) -> bool:
    """True when `fn` is an `async def` whose body has no suspension point at all, so one
    step of its coroutine always runs it to the end."""
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None or not inspect.iscoroutinefunction(func):
        return False
    return not any(ins.opname in _SUSPENDING_OPS for ins in dis.get_instructions(code))


@dataclass
class _Method:
    """A served method, the types its Struct-annotated arguments decode as, and whether it
    runs inline in the receive callback (it never suspends) or in a task of its own."""

    fn: Callable[..., Awaitable[Any]]
    inline: bool = False
    positional: list[Any] = field(default_factory=list)
    keyword: dict[str, Any] = field(default_factory=dict)
    plain: bool = True  # no argument decodes as a Struct: the body decodes in one go

    @classmethod
    def inspect(cls, fn: Callable[..., Awaitable[Any]]) -> _Method:
        method = cls(fn, never_suspends(fn))
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable annotations: decode everything untyped
            hints = {}
        for param in inspect.signature(fn).parameters.values():
            hint = hints.get(param.name, Any)
            type_ = hint if _mentions_struct(hint) else Any
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                method.positional.append(type_)
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                method.keyword[param.name] = type_
            if type_ is not Any:
                method.plain = False
        return method


class RpcServer:
    """Serves the public `async def` methods of `target` on a ZeroMQ ROUTER socket.

    `address` is a ZeroMQ endpoint (`tcp://127.0.0.1:0` binds a free port; `ipc:///path`);
    after entering, `address` holds the bound endpoint. `name` is the name callers connect to
    (their HELLO must name it). Messages that fail authentication, do not decode, exceed
    `max_message_bytes` together, or replay or reorder a session's messages are dropped and
    counted (`stats()`).
    """

    def __init__(
        self,
        target: object,
        address: str,
        secret: bytes,
        *,
        name: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={max_message_bytes!r}: must be positive")
        if max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes={max_inflight_bytes!r}: must be positive")
        self.target = target
        self.address = address
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.dropped_unauthenticated = 0
        self.dropped_malformed = 0
        self.dropped_oversized = 0
        self.dropped_replayed = 0
        self.dropped_misdirected = 0
        self.dropped_replies = 0
        self.refused_overloaded = 0
        self.calls_served = 0
        self._codec = Codec(secret)
        self._context = context
        self._own_context = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._reader: LoopSocket | None = None
        self._methods: dict[str, _Method] = {}
        self._calls: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._unstarted: set[tuple[bytes, int]] = set()  # call tasks created but not yet running
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()  # by ROUTER identity, LRU
        self._half_open: OrderedDict[bytes, _Session] = OrderedDict()

    async def __aenter__(self) -> RpcServer:
        if self._context is None:
            self._context = zmq.Context()
        sock: zmq.Socket[Any] = zmq.Socket(self._context, zmq.ROUTER)
        _configure(sock, self.max_message_bytes, sndhwm=REPLY_HWM, rcvhwm=CALL_HWM)
        # A reply to a peer whose queue is full, or that has gone, raises instead of vanishing.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A connection that has not completed ZeroMQ's handshake by then is closed: with the
        # default 30 s, a scanner's idle connections hold a descriptor each that long.
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"RPC server {self.name!r} cannot bind {self.address!r}: {exc}") from exc
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._task = asyncio.create_task(self._serve(), name=f"rpc-server:{self.name}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def stats(self) -> RpcStats:
        return RpcStats(
            calls_served=self.calls_served,
            in_flight=len(self._calls),
            sessions=len(self._sessions),
            dropped_unauthenticated=self.dropped_unauthenticated,
            dropped_malformed=self.dropped_malformed,
            dropped_oversized=self.dropped_oversized,
            dropped_replayed=self.dropped_replayed,
            dropped_misdirected=self.dropped_misdirected,
            dropped_replies=self.dropped_replies,
            refused_overloaded=self.refused_overloaded,
        )

    def _method(self, name: str) -> _Method:
        method = self._methods.get(name)
        if method is not None:
            return method
        fn = None if name.startswith("_") else getattr(self.target, name, None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            raise AttributeError(f"actor {self.name!r} has no public async method {name!r}")
        method = _Method.inspect(fn)
        self._methods[name] = method
        return method

    async def _serve(self) -> None:
        assert self._sock is not None
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._reader = LoopSocket(self._sock, self._dispatch)
            try:
                await asyncio.get_running_loop().create_future()  # until cancelled
            finally:
                self._reader.close()
                self._reader = None
                self._tg = None

    def _dispatch(self, msg: list[zmq.Frame]) -> None:
        try:
            self._receive(msg)
        except Exception:  # never let one message stop the server
            self.dropped_malformed += 1
            log.exception("RPC server %r dropped a message it could not handle", self.name)

    def _drop(self, what: str, identity: bytes) -> None:
        count = getattr(self, f"dropped_{what}") + 1
        setattr(self, f"dropped_{what}", count)
        _log_drop(f"RPC server {self.name!r}", what, count, f"peer {identity.hex()}")

    def _receive(self, msg: list[zmq.Frame]) -> None:
        if len(msg) == 2:  # identity and a message in the compact form
            self._receive_compact(msg[0].bytes, msg[1].buffer)
            return
        if len(msg) < 3:  # identity, envelope, seal at least
            self.dropped_malformed += 1
            return
        frames = [f.buffer for f in msg[1:]]
        size = sum(f.nbytes for f in frames)
        identity = msg[0].bytes
        if size > self.max_message_bytes:
            self._drop("oversized", identity)
            self._discard(msg, frames)
            return
        codec = self._codec
        env_bytes = frames[0].nbytes
        if is_large(env_bytes, size - env_bytes - frames[-1].nbytes):
            if not self._receive_large(identity, frames, size):
                self._discard(msg, frames)
            return
        if not codec.verify(frames, False):
            self._drop("unauthenticated", identity)
            return
        try:
            env = codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        header = read_header(frames[-1])
        if env.kind == Kind.HELLO and header[0] == _CALL:
            self._hello(identity, header[1], env)
            return
        session = self._take(identity, header)
        if session is not None:
            self._handle(identity, session, env, frames, size)

    def _receive_compact(self, identity: bytes, whole: memoryview) -> None:
        """A message in the compact form: one frame, no arrays, never large."""
        size = whole.nbytes
        opened = _open_compact(self._codec, whole, self.max_message_bytes)
        if isinstance(opened, str):
            if opened in ("short", "malformed"):
                self.dropped_malformed += 1
            else:
                self._drop(opened, identity)
            return
        env, header = opened
        if env.kind == Kind.HELLO and header[0] == _CALL:
            self._hello(identity, header[1], env)
            return
        session = self._take(identity, header)
        if session is not None:
            self._handle(identity, session, env, _NO_FRAMES, size)

    def _take(self, identity: bytes, header: SealHeader) -> _Session | None:
        """The session `header` continues on this connection, its sequence number taken; None
        (counted) for a message of another session or direction, or one already passed."""
        direction, tag, seq = header
        session = self._sessions.get(identity)
        established = session is not None
        if established:
            self._sessions.move_to_end(identity)
        else:
            session = self._half_open.get(identity)
        if session is None or direction != _CALL or tag != session.tag or seq <= session.recv_seq:
            self._drop("replayed", identity)
            return None
        session.recv_seq = seq
        if not established:
            # Its first message under the new tag shows the peer holds the secret; only now does
            # the session get a place that a flood of replayed HELLOs cannot take from it.
            del self._half_open[identity]
            self._sessions[identity] = session
            if len(self._sessions) > MAX_SESSIONS:
                old, _ = self._sessions.popitem(last=False)
                log.info("RPC server %r forgot the session of idle peer %s", self.name, old.hex())
        return session

    def _hello(self, identity: bytes, client_nonce: bytes, env: Envelope) -> None:
        codec = self._codec
        if env.method != self.name:
            self._drop("misdirected", identity)
            body = Codec.error_body(LookupError(f"this RPC server is {self.name!r}, not {env.method!r}"), "")
            refusal = codec.prepare(Kind.ERROR, 0, "", body)
            self._send(identity, codec.seal(refusal, Direction.REPLY, client_nonce, 0))
            return
        server_nonce = secrets.token_bytes(SESSION_BYTES)
        self._sessions.pop(identity, None)
        self._half_open.pop(identity, None)
        self._half_open[identity] = _Session(codec.session_tag(client_nonce, server_nonce, self.name))
        if len(self._half_open) > MAX_HALF_OPEN:
            self._half_open.popitem(last=False)
        welcome = codec.prepare(Kind.WELCOME, 0, self.name, server_nonce)
        self._send(identity, codec.seal(welcome, Direction.REPLY, client_nonce, 0))

    def _discard(self, msg: list[zmq.Frame], frames: list[memoryview]) -> None:
        """Let go of a dropped message in a worker thread: unmapping a few hundred MB of
        buffers takes the kernel tens of milliseconds, too long for the event loop."""
        held = msg[:]  # the only references left once the lists below are emptied
        msg.clear()
        frames.clear()
        if self._tg is not None:
            self._tg.create_task(asyncio.to_thread(held.clear), name=f"{self.name}.release")

    def _receive_large(self, identity: bytes, frames: list[memoryview], size: int) -> bool:
        """Check a large message's head; True when it goes on to be verified in a thread."""
        header = self._codec.check_head(frames)
        if header is None:  # a stranger's: dropped without hashing its bulk
            self._drop("unauthenticated", identity)
            return False
        session = self._take(identity, header)
        if session is None:
            return False
        assert self._reader is not None and self._tg is not None
        # Nothing more is read until this message is checked: what follows keeps its place in
        # ZeroMQ's bounded queues, and the event loop goes on meanwhile.
        self._reader.pause()
        self._tg.create_task(self._check_large(identity, session, frames, size), name=f"{self.name}.verify")
        return True

    async def _check_large(
        self, identity: bytes, session: _Session, frames: list[memoryview], size: int
    ) -> None:
        try:
            ok = await asyncio.to_thread(self._codec.verify, frames, True)
        finally:
            if self._reader is not None:
                self._reader.resume()
        if not ok:
            self._drop("unauthenticated", identity)
            return
        try:
            env = self._codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        if env.kind == Kind.HELLO:  # a HELLO is never large
            self.dropped_malformed += 1
            return
        try:
            self._handle(identity, session, env, frames, size)
        except Exception:  # never let one message stop the server
            self.dropped_malformed += 1
            log.exception("RPC server %r dropped a message it could not handle", self.name)

    def _handle(
        self, identity: bytes, session: _Session, env: Envelope, frames: Sequence[Any], size: int
    ) -> None:
        assert self._tg is not None
        if env.kind == Kind.CALL:
            try:
                method = self._method(env.method)
            except AttributeError as exc:
                self._reply(identity, session, Kind.ERROR, env.id, Codec.error_body(exc, ""))
                return
            if method.inline and not self._unstarted:
                self._call_inline(identity, session, env, frames, method)
                return
            if session.call_bytes and session.call_bytes + size > self.max_inflight_bytes:
                self.refused_overloaded += 1
                refusal = RpcOverloaded(
                    f"{self.name}.{env.method} refused: this caller's running calls hold "
                    f"{session.call_bytes} bytes, the limit is {self.max_inflight_bytes}"
                )
                self._reply(identity, session, Kind.ERROR, env.id, Codec.error_body(refusal, ""))
                return
            # A quick call behind a call whose task has not started yet also waits its
            # turn in a task, so one caller's calls still begin in the order sent.
            key = (identity, env.id)
            session.call_bytes += size
            task = self._tg.create_task(
                self._call(identity, session, env, frames, method), name=f"{self.name}.{env.method}"
            )
            self._calls[key] = task
            self._unstarted.add(key)
            # Also a done callback: a task cancelled before its first step never runs
            # the `finally` in `_call`.
            task.add_done_callback(functools.partial(self._call_done, key, session, size))
        elif env.kind == Kind.CANCEL:
            call = self._calls.get((identity, env.id))
            if call is not None:
                call.cancel()
        elif env.kind == Kind.PING:
            # Answered by the receive loop itself: a pong proves the loop is responsive.
            self._reply(identity, session, Kind.PONG, env.id, None)
        else:
            self.dropped_malformed += 1

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        if self._reader is None:  # closing: the caller sees the connection go
            return
        try:
            self._reader.send([identity, *frames])
        except zmq.Again:
            # REPLY_HWM replies wait unread at this peer: refuse to queue more, and say so.
            self._drop("replies", identity)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:  # else the peer has gone: no one to answer
                raise

    def _send_sealed(self, identity: bytes, session: _Session, out: Outgoing) -> None:
        session.send_seq += 1
        self._send(identity, self._codec.seal(out, Direction.REPLY, session.tag, session.send_seq))

    def _reply(self, identity: bytes, session: _Session, kind: Kind, call_id: int, body: Any) -> None:
        self._reply_out(identity, session, self._codec.prepare(kind, call_id, "", body))

    def _reply_out(self, identity: bytes, session: _Session, out: Outgoing) -> None:
        if not out.large:
            self._send_sealed(identity, session, out)
            return
        assert self._tg is not None
        self._tg.create_task(self._reply_large(identity, session, out), name=f"{self.name}.seal")

    async def _reply_large(self, identity: bytes, session: _Session, out: Outgoing) -> None:
        await asyncio.to_thread(out.hash)
        self._send_sealed(identity, session, out)

    def _decode_args(
        self, method: _Method, env: Envelope, frames: Sequence[Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        codec = self._codec
        if method.plain:
            try:
                args, kwargs = codec.decode(env.body, frames, _PlainCall)
            except msgspec.ValidationError as exc:
                raise TypeError(f"{self.name}.{env.method}: malformed arguments: {exc}") from None
            return args, kwargs
        body = codec.decode_call(env.body)
        args = []
        for i, raw in enumerate(body.args):
            type_ = method.positional[i] if i < len(method.positional) else Any
            try:
                args.append(codec.decode(raw, frames, type_))
            except msgspec.ValidationError as exc:
                raise TypeError(f"{self.name}.{env.method}: positional argument {i}: {exc}") from None
        kwargs = {}
        for key, raw in body.kwargs.items():
            try:
                kwargs[key] = codec.decode(raw, frames, method.keyword.get(key, Any))
            except msgspec.ValidationError as exc:
                raise TypeError(f"{self.name}.{env.method}: argument {key!r}: {exc}") from None
        return args, kwargs

    def _call_inline(
        self, identity: bytes, session: _Session, env: Envelope, frames: Sequence[Any], method: _Method
    ) -> None:
        """Run a method that never suspends right here, without a task: one step of its
        coroutine runs it to the end (its `asyncio.current_task()` is None)."""
        codec = self._codec
        try:
            args, kwargs = self._decode_args(method, env, frames)
            del frames
            coro = method.fn(*args, **kwargs)
            try:
                coro.send(None)  # type: ignore[attr-defined]
            except StopIteration as done:
                out = codec.prepare(Kind.RESULT, env.id, "", done.value)
            else:  # `never_suspends` rules this out; fail the call rather than lose it
                coro.close()  # type: ignore[attr-defined]
                raise RuntimeError(f"{self.name}.{env.method} suspended while run inline")
        except Exception as exc:
            out = codec.prepare(Kind.ERROR, env.id, "", Codec.error_body(exc, traceback.format_exc()))
        self.calls_served += 1
        self._reply_out(identity, session, out)

    def _call_done(
        self, key: tuple[bytes, int], session: _Session, size: int, task: asyncio.Task[None]
    ) -> None:
        self._calls.pop(key, None)
        self._unstarted.discard(key)
        session.call_bytes -= size

    async def _call(
        self, identity: bytes, session: _Session, env: Envelope, frames: Sequence[Any], method: _Method
    ) -> None:
        key = (identity, env.id)
        self._unstarted.discard(key)
        codec = self._codec
        try:
            try:
                args, kwargs = self._decode_args(method, env, frames)
                del frames  # let the request's buffers go as soon as the arguments hold them
                result = await method.fn(*args, **kwargs)
                out = codec.prepare(Kind.RESULT, env.id, "", result)
            except Exception as exc:
                out = codec.prepare(Kind.ERROR, env.id, "", Codec.error_body(exc, traceback.format_exc()))
            self.calls_served += 1
            if out.large:
                await asyncio.to_thread(out.hash)
            self._send_sealed(identity, session, out)
        finally:
            self._calls.pop(key, None)


class ActorHandle:
    """A caller's end of one actor: awaitable calls, many in flight, per-call timeouts."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        name: str,
        context: zmq.Context[Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.name = name
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.dropped_unauthenticated = 0
        self.dropped_malformed = 0
        self.dropped_replayed = 0
        self._codec = Codec(secret)
        self._context = context
        self._own_context = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._reader: LoopSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[Envelope, Sequence[Any]]]] = {}
        self._dead: BaseException | None = None
        self._final = False
        self._exit_hint: asyncio.Future[BaseException] | None = None
        self._session: _Session | None = None
        self._hello_nonce: bytes | None = None
        self._session_changed = asyncio.Event()  # set when a session opens or the handle dies
        self._order: deque[_Outbound] = deque()
        self._verifying: asyncio.Task[None] | None = None

    async def _open(self) -> None:
        if self._context is None:
            self._context = zmq.Context()
        sock: zmq.Socket[Any] = zmq.Socket(self._context, zmq.DEALER)
        _configure(sock, self.max_message_bytes, sndhwm=CALL_HWM, rcvhwm=REPLY_HWM)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            raise OSError(f"cannot connect to actor {self.name!r} at {self.address!r}: {exc}") from exc
        self._sock = sock
        self._reader = LoopSocket(sock, self._on_message, queue_sends=True)
        self._task = asyncio.create_task(self._run(sock, monitor), name=f"rpc-handle:{self.name}")

    async def __aenter__(self) -> ActorHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls still waiting fail with ActorDied."""
        for task in (self._task, self._verifying):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._verifying = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._end_session()
        self._fail_pending(ActorDied(self.name, reason="handle closed"))
        if self._dead is None:
            self._dead = ActorDied(self.name, reason="handle closed")
            self._final = True
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        if method.startswith("_"):
            raise AttributeError(method)
        fn = functools.partial(self.call, method)
        self.__dict__[method] = fn  # found directly next time, without this hook
        return fn

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def queued_sends(self) -> int:
        """Messages held back because ZeroMQ's bounded send queue is full (the server is not
        reading); they go, in order, as it makes room."""
        return self._reader.queued if self._reader is not None else 0

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._session_changed.set()  # callers waiting for a session see `_dead`

    def mark_dead(self, exc: BaseException) -> None:
        """Fail every waiting and future call with `exc` (the owner saw the actor end)."""
        self._dead = exc
        self._final = True
        self._fail_pending(exc)
        if self._exit_hint is not None and not self._exit_hint.done():
            self._exit_hint.set_result(exc)

    def expect_exit_report(self) -> None:
        """An owner will call `mark_dead` with details when the actor ends; on a lost
        connection, wait briefly for that report so callers see the exit code and log."""
        if self._exit_hint is None:
            self._exit_hint = asyncio.get_running_loop().create_future()

    async def _run(self, sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
        events: asyncio.Queue[Any] = asyncio.Queue(maxsize=_MONITOR_QUEUE)

        def on_event(msg: list[zmq.Frame]) -> None:
            events.put_nowait(parse_monitor_message([f.bytes for f in msg]))
            if events.full():  # the rest wait in ZeroMQ's (bounded) monitor queue
                watcher.pause()

        watcher = LoopSocket(monitor, on_event)
        try:
            await self._watch(events, watcher)
        finally:
            watcher.close()
            sock.disable_monitor()
            monitor.close(linger=0)

    async def _watch(self, events: asyncio.Queue[Any], watcher: LoopSocket) -> None:
        connected = False
        while True:
            event = await events.get()
            watcher.resume()
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
                if not self._final:
                    self._dead = None
                    self._start_session()
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                connected = False
                self._end_session()
                exc: BaseException = ActorDied(self.name, reason=f"connection to {self.address} lost")
                if self._exit_hint is not None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(2.0):
                            exc = await asyncio.shield(self._exit_hint)
                if not self._final:
                    self._dead = exc
                self._fail_pending(exc)

    # -- sessions ------------------------------------------------------------------------
    def _start_session(self) -> None:
        """Send a HELLO on a new connection; calls wait until its WELCOME opens the session."""
        self._end_session()
        nonce = secrets.token_bytes(SESSION_BYTES)
        self._hello_nonce = nonce
        if self._reader is not None:
            self._reader.send(self._codec.encode(Kind.HELLO, 0, self.name, None, session=nonce))

    def _end_session(self) -> None:
        self._session = None
        self._hello_nonce = None
        self._session_changed.clear()
        for entry in self._order:  # their callers fail with the connection
            entry.dropped = True
        self._order.clear()
        if self._reader is not None:
            self._reader.discard_queued()  # sealed for a session the server no longer has

    def _opened(self, env: Envelope, frames: Sequence[Any]) -> None:
        """The server's answer to our HELLO."""
        assert self._hello_nonce is not None
        if env.kind == Kind.WELCOME and env.method == self.name:
            server_nonce = self._codec.decode(env.body, frames, bytes)
            self._session = _Session(self._codec.session_tag(self._hello_nonce, server_nonce, self.name))
            self._hello_nonce = None
            self._session_changed.set()
        elif env.kind == Kind.ERROR:
            err = self._codec.decode_error(env.body)
            self.mark_dead(ActorDied(self.name, reason=f"{self.address} refused the session: {err.message}"))
        else:
            self.dropped_malformed += 1

    async def _wait_session(self) -> None:
        while self._session is None:
            if self._dead is not None:
                raise self._dead
            await self._session_changed.wait()
            if self._session is None and self._dead is None:
                self._session_changed.clear()  # woken for a session already gone: wait for the next

    # -- receiving -----------------------------------------------------------------------
    def _drop(self, what: str) -> None:
        count = getattr(self, f"dropped_{what}") + 1
        setattr(self, f"dropped_{what}", count)
        _log_drop(f"RPC handle {self.name!r}", what, count, self.address)

    def _take(self, header: SealHeader) -> bool:
        direction, tag, seq = header
        session = self._session
        if session is None or direction != _REPLY or tag != session.tag or seq <= session.recv_seq:
            self._drop("replayed")
            return False
        session.recv_seq = seq
        return True

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        if len(msg) == 1:
            self._on_compact(msg[0].buffer)
            return
        codec = self._codec
        frames = [f.buffer for f in msg]
        size = sum(f.nbytes for f in frames)
        if size > self.max_message_bytes:
            self.dropped_malformed += 1
            return
        env_bytes = frames[0].nbytes
        if is_large(env_bytes, size - env_bytes - frames[-1].nbytes):
            header = codec.check_head(frames)
            if header is None:
                self._drop("unauthenticated")
            elif self._take(header) and self._reader is not None:
                # As on the server: hash in a thread, read nothing more meanwhile.
                self._reader.pause()
                self._verifying = asyncio.create_task(self._check_large(frames), name=f"{self.name}.verify")
            return
        if not codec.verify(frames, False):
            self._drop("unauthenticated")
            return
        try:
            env = codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        header = read_header(frames[-1])
        if self._hello_nonce is not None and header[1] == self._hello_nonce and header[0] == _REPLY:
            self._opened(env, frames)
        elif self._take(header):
            self._deliver(env, frames)

    def _on_compact(self, whole: memoryview) -> None:
        """A message in the compact form: one frame, no arrays, never large."""
        opened = _open_compact(self._codec, whole, self.max_message_bytes)
        if isinstance(opened, str):
            if opened == "unauthenticated":
                self._drop("unauthenticated")
            else:
                self.dropped_malformed += 1
            return
        env, header = opened
        if self._hello_nonce is not None and header[1] == self._hello_nonce and header[0] == _REPLY:
            self._opened(env, _NO_FRAMES)
        elif self._take(header):
            self._deliver(env, _NO_FRAMES)

    async def _check_large(self, frames: list[memoryview]) -> None:
        try:
            ok = await asyncio.to_thread(self._codec.verify, frames, True)
        finally:
            self._verifying = None
            if self._reader is not None:
                self._reader.resume()
        if not ok:
            self._drop("unauthenticated")
            return
        try:
            env = self._codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        self._deliver(env, frames)

    def _deliver(self, env: Envelope, frames: Sequence[Any]) -> None:
        fut = self._pending.pop(env.id, None)
        if fut is not None and not fut.done():
            fut.set_result((env, frames))

    # -- sending -------------------------------------------------------------------------
    def _seal_and_send(self, out: Outgoing) -> None:
        session = self._session
        if session is None or self._reader is None:
            return  # the connection went: its callers fail with it
        session.send_seq += 1
        self._reader.send(self._codec.seal(out, Direction.CALL, session.tag, session.send_seq))

    def _submit(self, out: Outgoing) -> _Outbound | None:
        """Send `out` now, or return its place in line when it is large or has to wait behind
        a large one (sequence numbers, and so the server, follow the order of submission)."""
        if not out.large and not self._order:
            self._seal_and_send(out)
            return None
        entry = _Outbound(out, ready=not out.large)
        self._order.append(entry)
        return entry

    def _flush_order(self) -> None:
        order = self._order
        while order and (order[0].ready or order[0].dropped):
            entry = order.popleft()
            if not entry.dropped:
                self._seal_and_send(entry.out)

    async def _send_in_order(self, entry: _Outbound) -> None:
        try:
            if not entry.ready:
                await asyncio.to_thread(entry.out.hash)  # a large message: off the event loop
                entry.ready = True
        except BaseException:
            entry.dropped = True
            raise
        finally:
            self._flush_order()

    def _start(
        self, kind: Kind, call_id: int, method: str, body: Any, fut: asyncio.Future[Any]
    ) -> _Outbound | None:
        """Encode a request of the open session and send it, or return its place in line."""
        out = self._codec.prepare(kind, call_id, method, body)
        self._pending[call_id] = fut  # from here on, a CANCEL follows an abandoned call
        return self._submit(out)

    async def _exchange(
        self, kind: Kind, call_id: int, method: str, body: Any, fut: asyncio.Future[Any]
    ) -> tuple[Envelope, Sequence[Any]]:
        if self._session is None:
            await self._wait_session()
        entry = self._start(kind, call_id, method, body, fut)
        if entry is not None:
            await self._send_in_order(entry)
        return await fut  # type: ignore[no-any-return]

    async def _request(
        self,
        kind: Kind,
        method: str,
        body: Any,
        timeout: float | None,  # noqa: ASYNC109  # the API takes per-call timeouts
    ) -> tuple[Envelope, Sequence[Any]]:
        if self._dead is not None:
            raise self._dead
        call_id = next(self._ids)
        fut: asyncio.Future[tuple[Envelope, Sequence[Any]]] = asyncio.get_running_loop().create_future()
        try:
            if timeout is None:
                if self._session is None:
                    return await self._exchange(kind, call_id, method, body, fut)
                # `_exchange` inline: one coroutine fewer on the path of every call.
                entry = self._start(kind, call_id, method, body, fut)
                if entry is not None:
                    await self._send_in_order(entry)
                return await fut
            scope = asyncio.timeout(timeout)
            try:
                async with scope:
                    return await self._exchange(kind, call_id, method, body, fut)
            except TimeoutError:
                if scope.expired():
                    raise RpcTimeout(self.name, method or kind.name.lower(), timeout) from None
                raise
        except BaseException:
            if (
                kind == Kind.CALL
                and call_id in self._pending
                and (not fut.done() or fut.cancelled())
                and self._reader is not None
            ):
                # Tell the actor to stop working on a call nobody waits for any more.
                self._submit(self._codec.prepare(Kind.CANCEL, call_id, "", None))
            raise
        finally:
            self._pending.pop(call_id, None)

    async def call(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,  # noqa: ASYNC109  # the API takes per-call timeouts
        result_type: Any = Any,
        **kwargs: Any,
    ) -> Any:
        """Call `method` remotely; decode the result as `result_type` (default: plain msgpack)."""
        env, frames = await self._request(Kind.CALL, method, (args, kwargs), timeout)
        if env.kind == Kind.ERROR:
            err = self._codec.decode_error(env.body)
            raise RemoteError(err.type_name, err.message, err.traceback, actor=self.name, method=method)
        if env.kind != Kind.RESULT:
            raise RemoteError(
                "ProtocolError", f"unexpected reply kind {env.kind}", "", actor=self.name, method=method
            )
        try:
            return self._codec.decode(env.body, frames, result_type)
        except msgspec.ValidationError as exc:
            raise TypeError(
                f"{self.name}.{method} returned a value that is not {result_type!r}: {exc}"
            ) from None

    async def ping(self, timeout: float | None = None) -> None:  # noqa: ASYNC109  # the API takes per-call timeouts
        """Round trip to the actor's receive loop (not into any method): a liveness probe."""
        await self._request(Kind.PING, "", None, timeout)


async def connect(
    address: str,
    secret: bytes,
    *,
    name: str,
    timeout: float | None = None,  # noqa: ASYNC109  # the API takes per-call timeouts
    context: zmq.Context[Any] | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> ActorHandle:
    """A handle on the actor at `address`. With `timeout`, first wait until it answers a ping."""
    handle = ActorHandle(address, secret, name=name, context=context, max_message_bytes=max_message_bytes)
    await handle._open()
    if timeout is not None:
        try:
            await handle.ping(timeout=timeout)
        except BaseException:
            await handle.close()
            raise
    return handle


__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ActorHandle",
    "RpcServer",
    "RpcStats",
    "connect",
]

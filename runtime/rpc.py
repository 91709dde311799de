"""RPC over ZeroMQ: a ROUTER server that serves an object's async methods, DEALER handles.

    async with RpcServer(Counter(), "tcp://127.0.0.1:0", secret, name="counter") as server:
        async with await connect(server.address, secret, name="counter") as handle:
            await handle.add(3)                      # sugar for handle.call("add", 3)
            await handle.call("add", 3, timeout=1.0, result_type=int)

Every message is authenticated (see `tether.runtime.wire`). Sockets are read by the event
loop directly (`tether.runtime.loop_socket`), without a future per message. The server runs
each call in its own task, started in arrival order, so one caller's calls begin in the order
they were sent; many calls may be in flight. A caller that times out or is cancelled sends a CANCEL, which
cancels the remote task. Exceptions raised by a method are re-raised on the caller as
`RemoteError` with the remote type name, message and traceback text.

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
import traceback
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from tether.runtime.errors import ActorDied, RemoteError, RpcTimeout
from tether.runtime.loop_socket import LoopSocket
from tether.runtime.wire import Codec, Envelope, Kind, MalformedMessage

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


def _configure(sock: zmq.Socket[Any], max_message_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: flow control is the callers' business (they await replies); a full
    # queue would otherwise silently drop replies (ROUTER) or block the event loop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # libzmq's own guard against a single frame beyond the limit: it refuses the frame and
    # closes that connection, before any memory is spent on it.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


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
        return method


class RpcServer:
    """Serves the public `async def` methods of `target` on a ZeroMQ ROUTER socket.

    `address` is a ZeroMQ endpoint (`tcp://127.0.0.1:0` binds a free port; `ipc:///path`);
    after entering, `address` holds the bound endpoint. Frames that fail authentication, do
    not decode or exceed `max_message_bytes` together are dropped and counted in
    `dropped_unauthenticated`, `dropped_malformed` and `dropped_oversized`.
    """

    def __init__(
        self,
        target: object,
        address: str,
        secret: bytes,
        *,
        name: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={max_message_bytes!r}: must be positive")
        self.target = target
        self.address = address
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.dropped_unauthenticated = 0
        self.dropped_malformed = 0
        self.dropped_oversized = 0
        self.calls_served = 0
        self._codec = Codec(secret)
        self._context = context
        self._own_context = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._reader: LoopSocket | None = None
        self._methods: dict[str, _Method] = {}
        self._calls: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._unstarted: set[tuple[bytes, int]] = set()  # call tasks created but not yet running

    async def __aenter__(self) -> RpcServer:
        if self._context is None:
            self._context = zmq.Context()
        sock: zmq.Socket[Any] = zmq.Socket(self._context, zmq.ROUTER)
        _configure(sock, self.max_message_bytes)
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

    async def serve_forever(self) -> None:
        """Wait until the server stops (it stops only when closed or cancelled)."""
        if self._task is None:
            raise RuntimeError(f"RPC server {self.name!r} is not started (use `async with`)")
        await asyncio.shield(self._task)

    @property
    def in_flight(self) -> int:
        return len(self._calls)

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
            self._reader = LoopSocket(self._sock, functools.partial(self._dispatch, tg))
            try:
                await asyncio.get_running_loop().create_future()  # until cancelled
            finally:
                self._reader.close()
                self._reader = None

    def _dispatch(self, tg: asyncio.TaskGroup, msg: list[zmq.Frame]) -> None:
        try:
            self._handle(tg, msg)
        except Exception:  # never let one message stop the server
            self.dropped_malformed += 1
            log.exception("RPC server %r dropped a message it could not handle", self.name)

    def _handle(self, tg: asyncio.TaskGroup, msg: list[zmq.Frame]) -> None:
        if len(msg) < 3:  # identity, envelope, seal at least
            self.dropped_malformed += 1
            return
        frames = [f.buffer for f in msg[1:]]
        if sum(f.nbytes for f in frames) > self.max_message_bytes:
            self.dropped_oversized += 1
            return
        if not self._codec.verify(frames):
            self.dropped_unauthenticated += 1
            return
        try:
            env = self._codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        identity = msg[0].bytes
        if env.kind == Kind.CALL:
            try:
                method = self._method(env.method)
            except AttributeError as exc:
                self._reply(identity, self._codec.encode_error(env.id, exc, ""))
                return
            if method.inline and not self._unstarted:
                self._call_inline(identity, env, frames, method)
            else:
                # A quick call behind a call whose task has not started yet also waits its
                # turn in a task, so one caller's calls still begin in the order sent.
                key = (identity, env.id)
                task = tg.create_task(
                    self._call(identity, env, frames, method), name=f"{self.name}.{env.method}"
                )
                self._calls[key] = task
                self._unstarted.add(key)
                # Also a done callback: a task cancelled before its first step never runs
                # the `finally` in `_call`.
                task.add_done_callback(functools.partial(self._call_done, key))
        elif env.kind == Kind.CANCEL:
            call = self._calls.get((identity, env.id))
            if call is not None:
                call.cancel()
        elif env.kind == Kind.PING:
            # Answered by the receive loop itself: a pong proves the loop is responsive.
            self._reply(identity, self._codec.encode(Kind.PONG, env.id, "", None))
        else:
            self.dropped_malformed += 1

    def _reply(self, identity: bytes, frames: list[Any]) -> None:
        if self._reader is not None:  # else closing: the caller sees the connection go
            self._reader.send([identity, *frames])

    def _decode_args(
        self, method: _Method, env: Envelope, frames: list[memoryview]
    ) -> tuple[list[Any], dict[str, Any]]:
        codec = self._codec
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

    def _call_inline(self, identity: bytes, env: Envelope, frames: list[memoryview], method: _Method) -> None:
        """Run a method that never suspends right here, without a task: one step of its
        coroutine runs it to the end (its `asyncio.current_task()` is None)."""
        try:
            args, kwargs = self._decode_args(method, env, frames)
            del frames
            coro = method.fn(*args, **kwargs)
            try:
                coro.send(None)  # type: ignore[attr-defined]
            except StopIteration as done:
                reply = self._codec.encode(Kind.RESULT, env.id, "", done.value)
            else:  # `never_suspends` rules this out; fail the call rather than lose it
                coro.close()  # type: ignore[attr-defined]
                raise RuntimeError(f"{self.name}.{env.method} suspended while run inline")
        except Exception as exc:
            reply = self._codec.encode_error(env.id, exc, traceback.format_exc())
        self.calls_served += 1
        self._reply(identity, reply)

    def _call_done(self, key: tuple[bytes, int], task: asyncio.Task[None]) -> None:
        self._calls.pop(key, None)
        self._unstarted.discard(key)

    async def _call(self, identity: bytes, env: Envelope, frames: list[memoryview], method: _Method) -> None:
        key = (identity, env.id)
        self._unstarted.discard(key)
        try:
            try:
                args, kwargs = self._decode_args(method, env, frames)
                del frames  # let the request's buffers go as soon as the arguments hold them
                result = await method.fn(*args, **kwargs)
                reply = self._codec.encode(Kind.RESULT, env.id, "", result)
            except Exception as exc:
                reply = self._codec.encode_error(env.id, exc, traceback.format_exc())
            self.calls_served += 1
            self._reply(identity, reply)
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
        self._codec = Codec(secret)
        self._context = context
        self._own_context = context is None
        self._sock: zmq.Socket[Any] | None = None
        self._reader: LoopSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[Envelope, list[memoryview]]]] = {}
        self._dead: BaseException | None = None
        self._final = False
        self._exit_hint: asyncio.Future[BaseException] | None = None

    async def _open(self) -> None:
        if self._context is None:
            self._context = zmq.Context()
        sock: zmq.Socket[Any] = zmq.Socket(self._context, zmq.DEALER)
        _configure(sock, self.max_message_bytes)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            raise OSError(f"cannot connect to actor {self.name!r} at {self.address!r}: {exc}") from exc
        self._sock = sock
        self._reader = LoopSocket(sock, self._on_message)
        self._task = asyncio.create_task(self._run(sock, monitor), name=f"rpc-handle:{self.name}")

    async def __aenter__(self) -> ActorHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls still waiting fail with ActorDied."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
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
        return functools.partial(self.call, method)

    @property
    def alive(self) -> bool:
        return self._dead is None

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

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
        events: asyncio.Queue[Any] = asyncio.Queue()
        watcher = LoopSocket(
            monitor, lambda msg: events.put_nowait(parse_monitor_message([f.bytes for f in msg]))
        )
        try:
            await self._watch(events)
        finally:
            watcher.close()
            sock.disable_monitor()
            monitor.close(linger=0)

    async def _watch(self, events: asyncio.Queue[Any]) -> None:
        connected = False
        while True:
            event = await events.get()
            if event["event"] == zmq.EVENT_CONNECTED:
                connected = True
                if not self._final:
                    self._dead = None
            elif event["event"] == zmq.EVENT_DISCONNECTED and connected:
                connected = False
                exc: BaseException = ActorDied(self.name, reason=f"connection to {self.address} lost")
                if self._exit_hint is not None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(2.0):
                            exc = await asyncio.shield(self._exit_hint)
                if not self._final:
                    self._dead = exc
                self._fail_pending(exc)

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        codec = self._codec
        frames = [f.buffer for f in msg]
        if sum(f.nbytes for f in frames) > self.max_message_bytes:
            self.dropped_malformed += 1
            return
        if not codec.verify(frames):
            self.dropped_unauthenticated += 1
            return
        try:
            env = codec.open(frames)
        except MalformedMessage:
            self.dropped_malformed += 1
            return
        fut = self._pending.pop(env.id, None)
        if fut is not None and not fut.done():
            fut.set_result((env, frames))

    def _send(self, frames: list[Any]) -> None:
        if self._reader is None:
            raise ActorDied(self.name, reason="handle closed")
        self._reader.send(frames)

    async def _request(
        self,
        kind: Kind,
        method: str,
        body: Any,
        timeout: float | None,  # noqa: ASYNC109  # the API takes per-call timeouts
    ) -> tuple[Envelope, list[memoryview]]:
        if self._dead is not None:
            raise self._dead
        call_id = next(self._ids)
        frames = self._codec.encode(kind, call_id, method, body)
        fut: asyncio.Future[tuple[Envelope, list[memoryview]]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            self._send(frames)
            del frames
            if timeout is None:
                return await fut
            try:
                async with asyncio.timeout(timeout):
                    return await fut
            except TimeoutError:
                raise RpcTimeout(self.name, method or kind.name.lower(), timeout) from None
        except BaseException:
            if kind == Kind.CALL and (not fut.done() or fut.cancelled()) and self._reader is not None:
                # Tell the actor to stop working on a call nobody waits for any more.
                self._send(self._codec.encode(Kind.CANCEL, call_id, "", None))
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


__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "ActorHandle", "RpcServer", "connect"]

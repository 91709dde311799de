"""A ZeroMQ socket driven by the running event loop's `add_reader`, without a future per message.

`zmq.asyncio` makes a future, a poller registration and several callbacks for every receive
and send; at RPC sizes that dominated the round trip. Here the loop watches the socket's
ZMQ_FD and, when it fires, drains every waiting message with NOBLOCK and hands each to a
plain callback. Sends go out at once with NOBLOCK (small frames copied: a zero-copy frame costs
more to set up than copying a few hundred bytes). The sockets have bounded high-water marks
(see `tether.runtime.rpc.actors`): a send that finds the queue full either raises `zmq.Again` to the
caller or, with `queue_sends`, waits in an outbox, in order, until ZeroMQ takes it. `pause()`
stops reading (the sender's ZeroMQ queues then fill and push back), `resume()` reads again.

ZMQ_FD is edge-triggered and any operation on the socket (a send included) may consume the
edge that announced new input, so after a send outside a drain the socket's ZMQ_EVENTS is
checked at once and a drain is scheduled if input is waiting. (Scheduling a drain after
every send instead would share one check among the sends of a loop iteration, but costs a
round trip one more pass of the event loop, with its poll syscall.)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

log = logging.getLogger(__name__)

# Messages handled per loop callback before yielding to other callbacks, so that one busy
# socket does not starve timers and other sockets.
DRAIN_BATCH = 256
_MORE = zmq.NOBLOCK | zmq.SNDMORE
# Plain ints: `int & zmq.POLLIN` would build an enum member on every test.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = zmq.EVENTS
_NOBLOCK = int(zmq.NOBLOCK)
# Frames up to this size are copied into ZeroMQ's message; larger ones go zero-copy.
COPY_BELOW = 1 << 16


class LoopSocket:
    """Calls `on_message(frames)` for each multipart message arriving on `sock`.

    Frames arrive as `zmq.Frame` objects (zero-copy). Create it inside a running loop; call
    `close()` before closing the socket.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[zmq.Frame]], None],
        *,
        queue_sends: bool = False,
    ) -> None:
        self.sock = sock
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._scheduled = False
        self._closed = False
        self._draining = False
        self._paused = False
        # Messages ZeroMQ refused (high-water mark): their senders already moved on, so they
        # wait here and go first when the socket can take more.
        self._outbox: deque[Sequence[Any]] | None = deque() if queue_sends else None
        self._loop.add_reader(self._fd, self._drain)
        # Messages may already be queued: the FD only signals changes, so look once now.
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._drain_scheduled)

    def _drain_scheduled(self) -> None:
        self._scheduled = False
        self._drain()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queued(self) -> int:
        """Messages waiting in the outbox for room in ZeroMQ's send queue."""
        return len(self._outbox) if self._outbox is not None else 0

    def pause(self) -> None:
        """Stop reading until `resume()` (sends go on)."""
        self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._schedule()

    def discard_queued(self) -> None:
        """Drop the messages still waiting in the outbox (their connection is gone)."""
        if self._outbox is not None:
            self._outbox.clear()

    def _drain(self) -> None:
        sock = self.sock
        self._draining = True
        try:
            for _ in range(DRAIN_BATCH):
                if self._closed:
                    return
                # ZMQ_EVENTS rather than a failing NOBLOCK recv: raising zmq.Again costs more.
                events = cast(int, sock.get(_EVENTS))
                if self._outbox and events & _POLLOUT:
                    self._flush()
                if self._paused or not events & _POLLIN:
                    return
                frame = sock.recv(_NOBLOCK, copy=False)
                msg = [frame]
                while frame.more:  # the rest of a multipart message is already here
                    frame = sock.recv(_NOBLOCK, copy=False)
                    msg.append(frame)
                del frame  # the handler owns the frames now: it may let them go elsewhere
                try:
                    self._on_message(msg)
                except Exception:  # one bad message must not stop the reader
                    log.exception("message handler failed")
                del msg
            self._schedule()  # more may be waiting; let other callbacks run first
        except zmq.ZMQError as exc:  # the socket went away under us (context terminated)
            log.debug("socket read stopped: %s", exc)
        finally:
            self._draining = False

    def _send_now(self, frames: Sequence[Any]) -> None:
        """Hand a multipart message to ZeroMQ; zmq.Again when its queue is full. The
        high-water mark is checked on the first frame only, so a message goes whole or not."""
        send = self.sock.send
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            small = type(frame) is bytes and len(frame) < COPY_BELOW
            send(frame, _MORE if i < last else _NOBLOCK, copy=small)

    def _flush(self) -> None:
        outbox = self._outbox
        assert outbox is not None
        try:
            while outbox:
                self._send_now(outbox[0])
                outbox.popleft()
        except zmq.Again:
            pass  # ZMQ_FD fires again when there is room

    def send(self, frames: Sequence[Any]) -> None:
        """Send a multipart message without blocking (copy=False: large buffers go zero-copy).

        When ZeroMQ's queue is full: raises zmq.Again, or with `queue_sends` keeps the message
        in the outbox, behind any already waiting there.
        """
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
        outbox = self._outbox
        if outbox:
            outbox.append(frames)
        else:
            try:
                self._send_now(frames)
            except zmq.Again:
                if outbox is None:
                    raise
                outbox.append(frames)
        # A drain in progress looks at ZMQ_EVENTS again anyway.
        if not self._draining and not self._scheduled:
            events = cast(int, self.sock.get(_EVENTS))
            if events & _POLLIN or (outbox and events & _POLLOUT):
                self._schedule()

    def close(self) -> None:
        """Stop watching the socket (the socket itself stays open for its owner to close)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)

"""A ZeroMQ socket driven by the running event loop's `add_reader`, without a future per message.

`zmq.asyncio` makes a future, a poller registration and several callbacks for every receive
and send; at RPC sizes that dominated the round trip. Here the loop watches the socket's
ZMQ_FD and, when it fires, drains every waiting message with NOBLOCK and hands each to a
plain callback. Sends go out at once with NOBLOCK: the sockets run with unbounded
high-water marks (see `tether.runtime.rpc`), so a send never has to wait.

ZMQ_FD is edge-triggered and any operation on the socket (a send included) may consume the
edge that announced new input, so after each send the socket's ZMQ_EVENTS is checked and a
drain is scheduled if input is waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

log = logging.getLogger(__name__)

# Messages handled per loop callback before yielding to other callbacks, so that one busy
# socket does not starve timers and other sockets.
DRAIN_BATCH = 256
_MORE = zmq.NOBLOCK | zmq.SNDMORE


class LoopSocket:
    """Calls `on_message(frames)` for each multipart message arriving on `sock`.

    Frames arrive as `zmq.Frame` objects (zero-copy). Create it inside a running loop; call
    `close()` before closing the socket.
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[zmq.Frame]], None]) -> None:
        self.sock = sock
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._scheduled = False
        self._closed = False
        self._draining = False
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

    def _drain(self) -> None:
        sock = self.sock
        self._draining = True
        try:
            for _ in range(DRAIN_BATCH):
                # ZMQ_EVENTS rather than a failing NOBLOCK recv: raising zmq.Again costs more.
                if self._closed or not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frame = sock.recv(zmq.NOBLOCK, copy=False)
                msg = [frame]
                while frame.more:  # the rest of a multipart message is already here
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                    msg.append(frame)
                try:
                    self._on_message(msg)
                except Exception:  # one bad message must not stop the reader
                    log.exception("message handler failed")
            self._schedule()  # more may be waiting; let other callbacks run first
        except zmq.ZMQError as exc:  # the socket went away under us (context terminated)
            log.debug("socket read stopped: %s", exc)
        finally:
            self._draining = False

    def send(self, frames: Sequence[Any]) -> None:
        """Queue a multipart message without blocking (copy=False: large buffers go zero-copy)."""
        if self._closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "socket is closed")
        sock = self.sock
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            sock.send(frame, _MORE if i < last else zmq.NOBLOCK, copy=False)
        # A drain in progress looks at ZMQ_EVENTS again anyway.
        if not self._draining and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._schedule()

    def close(self) -> None:
        """Stop watching the socket (the socket itself stays open for its owner to close)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)

"""The systemd notification protocol (sd_notify), written directly: a datagram to NOTIFY_SOCKET.

notifier = Notifier.from_env()       # does nothing when not run by systemd
notifier.ready()
notifier.status("step 12/100")
tg.create_task(notifier.watchdog_loop())   # WATCHDOG=1 every WATCHDOG_USEC/2
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages; every method is a no-op without a NOTIFY_SOCKET."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        if address:
            if not (address.startswith("/") or address.startswith("@")):
                raise ValueError(f"NOTIFY_SOCKET={address!r}: expected a path or an @abstract name")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        text = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        # WATCHDOG_PID names the process the watchdog is meant for; ignore it elsewhere.
        if text and (not pid or pid == str(os.getpid())):
            try:
                usec = int(text)
            except ValueError:
                raise ValueError(
                    f"WATCHDOG_USEC={text!r}: expected an integer number of microseconds"
                ) from None
            if usec <= 0:
                usec = None
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def notify(self, message: str) -> bool:
        """Send one message (lines `KEY=value`); False when not under systemd or on failure."""
        if self._sock is None or self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto(message.encode(), target)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text.replace(chr(10), ' ')}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    async def watchdog_loop(self) -> None:
        """Ping the watchdog every WATCHDOG_USEC/2 while the loop runs this task on time.

        A ping that wakes up later than a full watchdog period means the loop was blocked;
        that ping is skipped, so systemd sees the stall instead of a ping from a sick loop.
        """
        if self.watchdog_usec is None or not self.enabled:
            return
        loop = asyncio.get_running_loop()
        period = self.watchdog_usec / 1e6
        while True:
            before = loop.time()
            await asyncio.sleep(period / 2)
            if loop.time() - before < period:
                self.watchdog()

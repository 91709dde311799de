"""A stand-in for systemd's notify socket (the `notify_socket` fixture in tests/conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NotifySocket:
    """A stand-in for systemd's notify socket: records (arrival time, message) of every datagram."""

    path: Path
    messages: list[tuple[float, str]] = field(default_factory=list)
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> NotifySocket:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._receive, name="notify-socket", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        assert self._thread is not None and self._sock is not None
        self._thread.join(timeout=5)
        self._sock.close()

    def _receive(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, message: str) -> list[float]:
        return [t for t, m in list(self.messages) if message in m.split("\n")]

    def wait_for(self, predicate: object, deadline: float, proc: subprocess.Popen[str]) -> None:
        assert callable(predicate)
        while not predicate():
            assert proc.poll() is None, (
                f"tether run exited {proc.returncode} early:\n{proc.communicate()[0][-4000:]}"
            )
            assert time.monotonic() < deadline, f"timed out; got {self.messages[-10:]}"
            time.sleep(0.05)

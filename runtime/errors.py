"""Exception types shared by every tether component, and how a command line reports the
user's own mistakes (`UserError`): one line, no traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

DEBUG_ENV = "TETHER_DEBUG"  # set (not "0"): user errors show their traceback too (`tether --debug`)
USAGE_EXIT = 2  # argparse's status for a bad command line; every user error exits with it


class UserError(Exception):
    """What the user asked for cannot be done: the message names the flag, key or file and says
    what to change. Command lines print it as one line, `tether <command>: <message>`."""


class ConfigError(UserError, ValueError):
    """A configuration key or flag holds a value tether cannot run with.

    The message always names the key (as the user wrote it: `--flag-name` or a YAML key) and
    the offending value (None: the key was not given), so the user can fix the input without
    reading our code.
    """

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}: {reason}" if value is None else f"{key}={value!r}: {reason}")


# A file the user named that is missing or cannot be opened: the error carries its path.
_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def user_error(exc: BaseException) -> BaseException | None:
    """The user's mistake `exc` reports, or None when it may be a bug (which keeps its traceback):
    a UserError, an OSError naming its file, or a group whose every exception is one of these."""
    if isinstance(exc, BaseExceptionGroup):
        found = [user_error(e) for e in exc.exceptions]
        return found[0] if all(e is not None for e in found) else None
    if isinstance(exc, UserError) or (isinstance(exc, _FILE_ERRORS) and exc.filename is not None):
        return exc
    if isinstance(exc, RemoteError) and exc.type_name in _user_error_names():
        return exc  # a trainer rank refused the user's input (an HF checkpoint it cannot read, ...)
    return None


def _user_error_names() -> set[str]:
    """The qualified names of UserError and every subclass this process knows, as RemoteError
    carries a remote exception's type (both sides run the same tether)."""
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(f"{cls.__module__}.{cls.__qualname__}")
        todo.extend(cls.__subclasses__())
    return names


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (a file error as `PATH: reason`)."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, RemoteError):  # the remote message, not its traceback
        return f"{_joined(exc.message)} (on {exc.actor or 'a remote process'})"
    return _joined(str(exc))


def _joined(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def exit_on_user_error(prog: str, main: Callable[[], int]) -> int:
    """Run a command's `main`; a user error becomes one line on stderr and exit status 2, while
    anything else (a bug) propagates with its traceback. TETHER_DEBUG=1 re-raises user errors too."""
    try:
        return main()
    except Exception as exc:
        error = user_error(exc)
        if error is None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"{prog}: {one_line(error)}", file=sys.stderr, flush=True)
        return USAGE_EXIT


class RemoteError(Exception):
    """An exception raised inside a remote method, re-raised on the caller's side.

    `type_name` is the remote exception's qualified type name (`module.Class`), `message` its
    text and `remote_traceback` the formatted traceback as the remote side printed it.
    """

    def __init__(
        self, type_name: str, message: str, remote_traceback: str, *, actor: str = "", method: str = ""
    ):
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        self.actor = actor
        self.method = method
        where = f"{actor}.{method}" if actor or method else "remote call"
        super().__init__(
            f"{where} raised {type_name}: {message}\n--- remote traceback ---\n{remote_traceback}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_remote_error,
            (self.type_name, self.message, self.remote_traceback, self.actor, self.method),
        )


def _rebuild_remote_error(type_name: str, message: str, tb: str, actor: str, method: str) -> RemoteError:
    return RemoteError(type_name, message, tb, actor=actor, method=method)


class ActorDied(RuntimeError):
    """A process or actor ended (or became unreachable) while someone still needed it.

    Carries the actor's name, its exit code or the signal that killed it (both None when only
    the connection was lost) and the last lines of its log.
    """

    def __init__(
        self,
        name: str,
        *,
        returncode: int | None = None,
        signal: int | None = None,
        log_tail: str = "",
        reason: str = "",
    ):
        self.name = name
        self.returncode = returncode
        self.signal = signal
        self.log_tail = log_tail
        self.reason = reason
        super().__init__(self._describe())

    def _describe(self) -> str:
        import signal as _signal

        if self.signal is not None:
            try:
                how = f"killed by {_signal.Signals(self.signal).name}"
            except ValueError:
                how = f"killed by signal {self.signal}"
        elif self.returncode is not None:
            how = f"exited with code {self.returncode}"
        else:
            how = "is unreachable"
        text = f"actor {self.name!r} {how}"
        if self.reason:
            text += f" ({self.reason})"
        if self.log_tail:
            text += f"; last log lines:\n{self.log_tail}"
        return text

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_actor_died, (self.name, self.returncode, self.signal, self.log_tail, self.reason))


def _rebuild_actor_died(
    name: str, returncode: int | None, signal: int | None, log_tail: str, reason: str
) -> ActorDied:
    return ActorDied(name, returncode=returncode, signal=signal, log_tail=log_tail, reason=reason)


class RpcTimeout(TimeoutError):
    """A remote call did not answer within its per-call timeout (the call was cancelled remotely)."""

    def __init__(self, actor: str, method: str, timeout: float):
        self.actor = actor
        self.method = method
        self.timeout = timeout
        super().__init__(f"{actor}.{method} did not answer within {timeout:g} s")


class RpcOverloaded(RuntimeError):
    """An RPC server refused a call: the caller's calls still running there already hold the
    server's per-caller limit of message bytes (the caller sees it as a RemoteError)."""


class HeartbeatLost(RuntimeError):
    """A liveness probe failed or did not answer in time."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name}: heartbeat lost ({reason})")


class NodeLost(RuntimeError):
    """A node's agent is lost (killed, frozen or cut off past the heartbeat tolerance): nothing
    can start or stop there until an agent registers for the node again."""

    def __init__(self, node: str, reason: str):
        self.node = node
        self.reason = reason
        super().__init__(f"node {node!r} is lost ({reason})")


_Found = TypeVar("_Found", bound=BaseException)


def find_exception(exc: BaseException, kind: type[_Found], *, causes: bool = False) -> _Found | None:
    """The first exception of `kind` in `exc` or inside its exception groups (a TaskGroup's), and
    with `causes` along each one's `__cause__` too. Each exception is visited once: a group's member
    may name its own group as its cause."""
    seen: set[int] = set()

    def walk(e: BaseException) -> _Found | None:
        if id(e) in seen:
            return None
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                found = walk(inner)
                if found is not None:
                    return found
        return walk(e.__cause__) if causes and e.__cause__ is not None else None

    return walk(exc)

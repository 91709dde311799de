"""Exception types shared by every tether component."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or flag holds a value tether cannot run with.

    The message always names the key (as the user wrote it: `--flag-name` or a YAML key) and
    the offending value, so the user can fix the input without reading our code.
    """

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}={value!r}: {reason}")


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

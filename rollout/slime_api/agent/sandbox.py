"""`slime.agent.sandbox`: the sandbox contract agent rollouts run against, and its backends.

A `Sandbox` is an async context manager with three operations: `exec` a shell command, and
`write_file` / `read_file`. Everything an agent example does in a sandbox (install a CLI, set
up a workspace, run the agent, grade a diff) is built from those, so one example runs on any
backend:

* `E2BSandbox(image)`: slime's backend, a sandbox of an E2B (or E2B-compatible) service booted
  from `image`, with the `e2b` package imported only when one is entered. Its settings come
  from the arguments or the environment under slime's names (`SLIME_AGENT_SANDBOX_*`, legacy
  `SWE_*`).
* `LocalSandbox()` (tether's; tether.rollout.slime_api.agent.local_sandbox): the same contract on
  this machine, with bubblewrap, for a run with no sandbox service.

`SLIME_AGENT_SANDBOX_BACKEND=local` makes `E2BSandbox(...)` itself run a LocalSandbox, so
slime's unchanged example code (which constructs `E2BSandbox(image)`) runs on one machine. The
`image` then seeds the sandbox where it names a host directory (its tree laid over the
sandbox's root: `<image>/testbed/...` is `/testbed/...`) and is otherwise ignored; the
sandbox's `timeout` still ends it.

`exec_and_wait` runs a long command (an agent, a test suite) the way E2B needs: detached in
the sandbox, its exit code dropped in a marker file that short, repeatable `exec`s poll for,
so no response stream has to stay open for the command's whole run.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import shlex
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

from tether.rollout.slime_api.agent.local_sandbox import (
    ExecTimeout,
    LocalSandbox,
    LocalSandboxUnavailable,
)

__all__ = [
    "BACKEND_ENV",
    "DONE_MARKER_POLL_SEC",
    "EXIT_TIME_BUDGET_EXCEEDED",
    "E2BSandbox",
    "ExecResult",
    "ExecTimeout",
    "FileContent",
    "LocalSandbox",
    "LocalSandboxUnavailable",
    "Sandbox",
    "ensure_agent_user",
    "exec_and_wait",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

ExecResult = tuple[int, str, str]
"""(exit code, stdout, stderr) of one command."""
FileContent = str | bytes | Path
"""What `write_file` takes: text, bytes, or a host file whose bytes are sent."""

EXIT_TIME_BUDGET_EXCEEDED = -1
"""The exit code `exec_and_wait` reports when the command outlived its time budget."""

DONE_MARKER_POLL_SEC = 5.0
"""How often `exec_and_wait` looks for the done marker (slime's 5 s); each look is one short exec,
which also keeps an idle-collected remote sandbox alive."""

BACKEND_ENV = "SLIME_AGENT_SANDBOX_BACKEND"
"""`e2b` (the default) or `local`: what `E2BSandbox(...)` runs."""


@runtime_checkable
class Sandbox(Protocol):
    """What agent rollouts need of a sandbox.

    `write_file` takes text, bytes, or a host `Path` whose bytes are streamed in. `idempotent`
    tells a backend that retries its transport whether the command may run twice (a replay of
    a spawn could double-execute it); backends that do not retry ignore it.
    """

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,  # noqa: ASYNC109  # slime's contract: per-command timeouts
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


async def _await_done_marker(
    sb: Sandbox, done_file: str, *, user: str, time_budget_sec: float, poll_sec: float
) -> int:
    """The exit code the detached command wrote to `done_file`, polled every `poll_sec`; or
    EXIT_TIME_BUDGET_EXCEEDED once `time_budget_sec` has passed without it."""
    deadline = time.monotonic() + time_budget_sec
    probe = f"test -f {shlex.quote(done_file)} && cat {shlex.quote(done_file)}"
    while time.monotonic() < deadline:
        await asyncio.sleep(poll_sec)
        code, out, _ = await sb.exec(probe, user=user, timeout=15, check=False)
        text = (out or "").strip()
        if code == 0 and text:
            try:
                return int(text)
            except ValueError:  # caught mid-write: look again next time
                continue
    return EXIT_TIME_BUDGET_EXCEEDED


async def exec_and_wait(
    sb: Sandbox,
    *,
    cmd: str,
    time_budget_sec: int,
    tag: str,
    user: str = "root",
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    out_file: str | None = None,
    want_output: bool = False,
    poll_sec: float | None = None,
) -> tuple[int, str]:
    """Run `cmd` detached in the sandbox until it ends; (exit code, output).

    The steps, each a short exec that is safe to repeat: write a launcher `/tmp/.{tag}.sh` that
    runs `cmd` in a subshell (in `workdir`, with HOME=/home/{user}, when given; an `exit` in it
    ends only the subshell) and writes its exit code to `/tmp/.{tag}.done`; clear the previous run's marker, output and spawn lock; spawn the
    launcher with `setsid`, output to `out_file` (default `/tmp/.{tag}.out`), guarded by the
    lock directory `/tmp/.{tag}.spawned` so a transport replay of the spawn cannot start it
    twice; poll for the marker every `poll_sec` (default DONE_MARKER_POLL_SEC) until
    `time_budget_sec` runs out (EXIT_TIME_BUDGET_EXCEEDED; the command is left running).

    The output returned: all of it with `want_output`, else "" on success and the last 512
    bytes on failure. Two calls with the same tag must not overlap.
    """
    out_file = out_file or f"/tmp/.{tag}.out"
    done_file, launcher, lock_dir = f"/tmp/.{tag}.done", f"/tmp/.{tag}.sh", f"/tmp/.{tag}.spawned"
    q = shlex.quote
    setup = f"cd {q(workdir)}\nexport HOME=/home/{user}\n" if workdir else ""
    # `cmd` runs in a subshell, so an `exit` in it still leaves the marker written.
    body = f"#!/bin/bash\n{setup}(\n{cmd}\n)\necho $? > {q(done_file)}\n"
    await sb.write_file(launcher, body, user=user)
    # Clearing is its own call, before the guarded spawn: inside it, the lock would skip the
    # clearing for every later run with this tag, and those would read this run's marker.
    await sb.exec(
        f"rm -rf {q(lock_dir)}; rm -f {q(out_file)} {q(done_file)}", user=user, timeout=30, check=True
    )
    await sb.exec(
        f"chmod +x {q(launcher)}; mkdir {q(lock_dir)} 2>/dev/null || exit 0; "
        f"setsid bash {q(launcher)} < /dev/null > {q(out_file)} 2>&1 &",
        user=user,
        env=env,
        timeout=30,
        check=True,
        idempotent=True,
    )
    interval = DONE_MARKER_POLL_SEC if poll_sec is None else poll_sec
    code = await _await_done_marker(
        sb, done_file, user=user, time_budget_sec=time_budget_sec, poll_sec=interval
    )
    if want_output:
        return code, await sb.read_file(out_file, user=user)
    if code == 0:
        return code, ""
    _, tail, _ = await sb.exec(f"tail -c 512 {q(out_file)} 2>/dev/null", user=user, timeout=15, check=False)
    return code, tail or ""


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """Make sure the unprivileged `agent` user exists and owns its home and `workdir`, and that
    git trusts every directory (the repository belongs to someone else for root's evaluation
    runs). Idempotent."""
    await sb.exec(
        "id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && "
        f"chown -R agent:agent /home/agent {shlex.quote(workdir)} && "
        "git config --system --add safe.directory '*' && id agent",
        user="root",
        check=True,
        timeout=60,
    )


def _getenv(*names: str, default: str = "") -> str:
    """The first of `names` set to something non-blank in the environment, else `default`
    (a setting's current name first, its legacy names after)."""
    for name in names:
        value = os.environ.get(name, "")
        if value.strip():
            return value
    return default


def backend_from_env() -> str:
    """`e2b` or `local`, from SLIME_AGENT_SANDBOX_BACKEND (default `e2b`)."""
    backend = _getenv(BACKEND_ENV, default="e2b").strip().lower()
    if backend not in ("e2b", "local"):
        raise ValueError(f"{BACKEND_ENV} must be 'e2b' or 'local', not {backend!r}")
    return backend


class E2BSandbox:
    """A sandbox of an E2B service (the `e2b` package's AsyncSandbox), or, with
    SLIME_AGENT_SANDBOX_BACKEND=local, a LocalSandbox under the same name (see the module doc).

    Settings, each an argument or else the environment (current name, then legacy):
    `timeout` (sandbox lifetime, SLIME_AGENT_SANDBOX_LIFETIME_SEC / SWE_SANDBOX_LIFETIME_SEC,
    3600), `image_metadata_key` (the metadata key the gateway routes images by, required for E2B:
    SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY / SWE_SANDBOX_IMAGE_METADATA_KEY), `rpc_retries`
    (SLIME_AGENT_SANDBOX_RPC_RETRIES / SWE_RPC_RETRIES, 6) and `size`
    (SLIME_AGENT_E2B_SANDBOX_SIZE / SWE_E2B_SANDBOX_SIZE, "md"; sent as `<prefix>/size` beside the
    image key).

    Transient client failures (connection, protocol, timeout errors of httpx/httpcore, and
    SandboxExceptions other than a missing or stopped sandbox) are retried with full-jitter
    exponential backoff, the connection pool reset in between, except for an exec marked
    `idempotent=False`. A command over its `timeout` raises e2b's TimeoutException.
    """

    image_metadata_key_env = ("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY")
    lifetime_sec_env = ("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "SWE_SANDBOX_LIFETIME_SEC")
    rpc_retries_env = ("SLIME_AGENT_SANDBOX_RPC_RETRIES", "SWE_RPC_RETRIES")
    size_env = ("SLIME_AGENT_E2B_SANDBOX_SIZE", "SWE_E2B_SANDBOX_SIZE")

    default_lifetime_sec = 3600
    default_rpc_retries = 6
    default_size = "md"
    rpc_backoff_base_sec = 1.0
    rpc_backoff_cap_sec = 32.0

    _TRANSIENT_RPC_ERRORS = frozenset(
        {
            "ProtocolError",
            "LocalProtocolError",
            "RemoteProtocolError",
            "WriteError",
            "ReadError",
            "ConnectError",
            "ConnectTimeout",
            "ReadTimeout",
            "WriteTimeout",
            "PoolTimeout",
            "SSLError",
        }
    )
    """Client-side failures (by class name, so the e2b and httpx packages need not be imported)."""

    def __init__(
        self,
        image: str,
        *,
        timeout: int | None = None,
        image_metadata_key: str | None = None,
        rpc_retries: int | None = None,
        size: str | None = None,
    ) -> None:
        self.image = image
        self.timeout = timeout if timeout is not None else self._lifetime_sec_from_env()
        self.image_metadata_key = image_metadata_key or self._image_metadata_key_from_env()
        self.rpc_retries = rpc_retries if rpc_retries is not None else self._rpc_retries_from_env()
        self.size = size if size is not None else self._size_from_env()
        self.backend = backend_from_env()
        self.sandbox_id = ""
        self._sb: Any = None
        self._local: LocalSandbox | None = None
        if self.backend == "local":
            seed = Path(image) if image and Path(image).is_dir() else None
            self._local = LocalSandbox(seed=seed, lifetime_sec=self.timeout)

    @classmethod
    def _image_metadata_key_from_env(cls) -> str | None:
        return _getenv(*cls.image_metadata_key_env) or None

    @classmethod
    def _lifetime_sec_from_env(cls) -> int:
        return int(_getenv(*cls.lifetime_sec_env, default=str(cls.default_lifetime_sec)))

    @classmethod
    def _rpc_retries_from_env(cls) -> int:
        return int(_getenv(*cls.rpc_retries_env, default=str(cls.default_rpc_retries)))

    @classmethod
    def _size_from_env(cls) -> str:
        return _getenv(*cls.size_env, default=cls.default_size)

    @classmethod
    def _is_transient_rpc_error(cls, e: BaseException) -> bool:
        """Whether `e` is a passing client-side failure that a retry may get past."""
        name = type(e).__name__
        if name in cls._TRANSIENT_RPC_ERRORS:
            return True
        if name == "SandboxException":  # e2b's catch-all; a gone sandbox stays gone
            text = str(e)
            return "does not exist" not in text and "STOPPED state" not in text
        return False

    def _metadata(self) -> dict[str, str]:
        """The boot metadata: the image under the routing key, and the size beside it."""
        assert self.image_metadata_key is not None
        md = {self.image_metadata_key: self.image}
        if self.size:
            prefix, sep, _ = self.image_metadata_key.rpartition("/")
            md[f"{prefix}/size" if sep else "size"] = self.size
        return md

    async def _rpc_retry(
        self, op_name: str, call: Callable[[], Awaitable[T]], *, idempotent: bool = True
    ) -> T:
        """`await call()`, again after a transient failure (at most `rpc_retries` tries in all).

        A non-idempotent operation is never replayed: after a severed response the command may
        already be running, and a second copy could do its work twice."""
        attempts = max(1, self.rpc_retries)
        for attempt in range(attempts):
            try:
                return await call()
            except Exception as e:
                if not idempotent or not self._is_transient_rpc_error(e) or attempt + 1 >= attempts:
                    raise
                await self._reset_conn_pool()
                delay = random.uniform(
                    0.0, min(self.rpc_backoff_cap_sec, self.rpc_backoff_base_sec * 2**attempt)
                )
                logger.debug(
                    "[agent.sandbox] %s: transient %s (try %d/%d), again in %.1fs: %.120s",
                    op_name,
                    type(e).__name__,
                    attempt + 1,
                    attempts,
                    delay,
                    e,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _reset_conn_pool(self) -> None:
        """Close the sandbox client's connection pool so the next call opens a fresh connection."""
        try:
            await self._sb._transport.pool.aclose()
        except Exception as e:  # a client without one: nothing to reset
            logger.debug("[agent.sandbox] connection pool not reset: %s", e)

    async def __aenter__(self) -> E2BSandbox:
        if self._local is not None:
            await self._local.__aenter__()
            self.sandbox_id = self._local.sandbox_id
            return self
        try:
            from e2b import AsyncSandbox
        except ImportError:
            raise RuntimeError(
                "E2BSandbox needs the `e2b` package (pip install e2b) and an E2B-compatible service; "
                f"to run sandboxes on this machine instead, set {BACKEND_ENV}=local (tether's "
                "LocalSandbox, which needs root and bubblewrap)"
            ) from None
        if self.image_metadata_key is None:
            raise RuntimeError(
                f"{self.image_metadata_key_env[0]} is not set: export the metadata key your E2B gateway "
                f"routes images by (legacy name {self.image_metadata_key_env[1]})"
            )
        metadata = self._metadata()
        self._sb = await self._rpc_retry(
            "create", lambda: AsyncSandbox.create(timeout=self.timeout, metadata=metadata)
        )
        self.sandbox_id = self._sb.sandbox_id
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._local is not None:
            await self._local.__aexit__(exc_type, exc, tb)
            return
        if self._sb is None:
            return
        try:
            await self._sb.kill()
        except Exception as e:  # the service reaps it at its lifetime anyway
            logger.warning("[agent.sandbox] killing sandbox %s failed: %s", self.sandbox_id[:8], e)

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,  # noqa: ASYNC109  # slime's contract: per-command timeouts
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult:
        """Run `cmd` as `user`; (exit code, stdout, stderr). `check=True` raises RuntimeError on a
        non-zero exit."""
        if self._local is not None:
            return await self._local.exec(
                cmd, user=user, env=env, timeout=timeout, check=check, idempotent=idempotent
            )
        from e2b.sandbox.commands.command_handle import CommandExitException

        def quiet(_: str) -> None:
            return None

        try:
            res = await self._rpc_retry(
                f"exec({cmd[:60]!r})",
                lambda: self._sb.commands.run(
                    cmd, user=user, envs=env, timeout=timeout, on_stdout=quiet, on_stderr=quiet
                ),
                idempotent=idempotent,
            )
        except CommandExitException as e:
            if check:
                raise RuntimeError(
                    f"e2b exec failed (exit={e.exit_code}): {cmd[:120]}\n{(e.stderr or '')[:400]}"
                ) from None
            return e.exit_code, e.stdout or "", e.stderr or ""
        return res.exit_code, res.stdout or "", res.stderr or ""

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        """Write text, bytes or a host file's bytes to `sandbox_path` as `user`."""
        if self._local is not None:
            await self._local.write_file(sandbox_path, content, user=user)
            return
        if isinstance(content, str):
            await self._rpc_retry(
                f"write_file({sandbox_path})", lambda: self._sb.files.write(sandbox_path, content, user=user)
            )
            return

        async def send() -> None:
            # Binary content goes as a raw octet stream, uncompressed, with room for large uploads.
            if isinstance(content, Path):
                with open(content, "rb") as fp:  # noqa: ASYNC230  # opens at once; the SDK streams it
                    await self._sb.files.write(
                        sandbox_path, fp, user=user, gzip=False, use_octet_stream=True, request_timeout=600
                    )
            else:
                await self._sb.files.write(
                    sandbox_path,
                    io.BytesIO(content),
                    user=user,
                    gzip=False,
                    use_octet_stream=True,
                    request_timeout=600,
                )

        what = content.name if isinstance(content, Path) else f"{len(content)} bytes"
        await self._rpc_retry(f"write_file({sandbox_path} <- {what})", send)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The text of `sandbox_path`, or "" where it cannot be read."""
        if self._local is not None:
            return await self._local.read_file(sandbox_path, user=user)
        try:
            text: str = await self._rpc_retry(
                f"read_file({sandbox_path})", lambda: self._sb.files.read(sandbox_path, user=user)
            )
        except Exception:
            return ""
        return text

"""tether's `LocalSandbox`: slime's `Sandbox` contract on this machine, with no cloud service.

slime's coding-agent code assumes a container of its own per sample: it writes `/tmp/.run.sh`,
creates an `agent` user (`useradd`, `chown`, `git config --system`), unpacks Node into
`/opt/node22`, installs CLIs under `/usr/local`, and works in the task's directory (`/testbed`,
`/workspace/<repo>`). A LocalSandbox gives it that with bubblewrap (`bwrap`) and namespaces:

* **The file system.** Each sandbox owns a fresh host directory, `<base>/<sandbox_id>/`, whose
  `root/` is the sandbox's `/`. Into it the host's top-level directories are bound read-only
  (`/usr`, `/var`, `/srv`, ...), except:

  - private (`PRIVATE_DIRS`): `/tmp`, `/var/tmp`, `/home`, `/root`, `/run`, `/workspace` start
    empty and belong to the sandbox (`/tmp`, `/var/tmp` and `/workspace` writable by every
    sandbox user, as `/tmp` is); the host's are not visible. `$TETHER_AGENT_SANDBOX_PRIVATE_DIRS`
    (colon-separated) adds more, for a task directory whose name the host also has (`/data`);
  - layered (`LAYERED_DIRS`): `/etc`, `/opt`, `/usr/local` show the host's contents and take
    writes copy-on-write (overlayfs, the upper layer under `<base>/<sandbox_id>/layers/`, or in
    memory where the file system there cannot hold one), so `useradd`, `git config --system`,
    `/opt/node22` and `npm install -g --prefix=/usr/local` work and the host's stay untouched;
  - anything else: a path the host lacks (`/testbed`, `/data`) is simply made by root in the
    sandbox (`mkdir`, or `write_file`, which makes parent directories) and lives in `root/`.

  The base directory is `$TETHER_AGENT_SANDBOX_DIR`, else `<tmp>/tether-agent-sandboxes`; it is
  hidden inside every sandbox, so sandboxes cannot see each other.
* **Processes.** `__aenter__` starts one long-lived bwrap process, the sandbox's init, in new
  mount, PID, IPC and UTS namespaces (`--die-with-parent`: it dies with the Python process).
  Each `exec` joins those namespaces with `nsenter` and runs `bash -l -c CMD` (E2B's shell) in
  a session and process group of its own, so processes a command detaches (`setsid ... &`, the
  way `exec_and_wait` runs agents) outlive the call, as they do in E2B. `__aexit__` kills the
  init, which makes the kernel kill every process left in the sandbox, then removes the
  directory.
* **Users.** `user="root"` runs as uid 0 with Docker's default capabilities less NET_RAW and
  MKNOD (no CAP_SYS_ADMIN: it cannot mount, remount or leave the sandbox's view of the disk).
  Any other user must exist in the sandbox's own `/etc/passwd` (`ensure_agent_user` makes
  `agent`) and runs with that user's uid, gid and groups, no capabilities and `no_new_privs`.
  Those are real uids on the host: a uid the sandbox allocates (1000 onwards) may also name a
  host account, which can reach nothing of it outside the sandbox's view.
* **Network.** The host's, by default, so an agent reaches the adapter the host serves at
  `127.0.0.1:port`. `network="none"` (or `$TETHER_AGENT_SANDBOX_NETWORK=none`) gives the
  sandbox a namespace with loopback only.
* **Limits.** `exec(timeout=...)` kills the command's process group when the time runs out and
  raises `ExecTimeout` (E2B raises its TimeoutException; slime's callers treat both as an
  error). Each of stdout and stderr keeps its first `output_limit_bytes` (8 MiB), noting what
  was dropped. `lifetime_sec` (E2BSandbox passes its `timeout`) ends the whole sandbox.

It needs root (bwrap binding and overlay mounts, and `setpriv` to switch users); it is
confinement against mistakes of a model-driven agent, not a boundary against a hostile root.
`seed` names a host directory laid over the sandbox's root at start (`seed/testbed/x` becomes
`/testbed/x`): where E2B boots an image, a local run seeds the task's files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import stat
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

logger = logging.getLogger(__name__)

BASE_DIR_ENV = "TETHER_AGENT_SANDBOX_DIR"
NETWORK_ENV = "TETHER_AGENT_SANDBOX_NETWORK"
PRIVATE_DIRS_ENV = "TETHER_AGENT_SANDBOX_PRIVATE_DIRS"

PRIVATE_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/home", "/root", "/run", "/workspace")
"""Fresh per sandbox, the host's hidden."""
SHARED_SCRATCH_DIRS = frozenset({"/tmp", "/var/tmp", "/workspace"})
"""Private directories every sandbox user may write (mode 1777, as /tmp)."""
LAYERED_DIRS: tuple[str, ...] = ("/etc", "/opt", "/usr/local")
"""The host's contents, written copy-on-write."""
HIDDEN_TOP_LEVEL = frozenset({"proc", "dev", "lost+found"})
"""Host top-level entries never bound in (bwrap mounts a fresh /proc and a minimal /dev)."""

DEFAULT_OUTPUT_LIMIT_BYTES = 8 * 1024 * 1024
START_TIMEOUT_SEC = 30.0
DRAIN_GRACE_SEC = 1.0
"""After a command exits, how long its output pipes may stay open (held by something it left
running) before reading stops."""

ROOT_CAPABILITIES = (
    "chown",
    "dac_override",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "net_bind_service",
    "sys_chroot",
    "audit_write",
    "setfcap",
)
"""What root keeps in a sandbox: Docker's default set less net_raw (the network is the host's) and mknod."""

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Runs inside the sandbox's namespaces as host root: become the user, then the command. The
# user's home, uid and groups come from the sandbox's own /etc/passwd and /etc/group.
_ENTER = r"""
user=$1 cmd=$2
entry=$(getent passwd "$user") || {
    echo "LocalSandbox: no user '$user' in this sandbox (ensure_agent_user creates 'agent')" >&2
    exit 126
}
home=$(printf '%s' "$entry" | cut -d: -f6)
export HOME="${HOME:-$home}" USER="$user" LOGNAME="$user"
cd "$HOME" 2>/dev/null || cd /
if [ "$user" = root ]; then
    exec setpriv --bounding-set=-all,+CAPS -- /bin/bash -l -c "$cmd"
fi
exec setpriv --reuid="$user" --regid="$(id -g "$user")" --init-groups --no-new-privs \
    --inh-caps=-all --bounding-set=-all -- /bin/bash -l -c "$cmd"
""".replace("CAPS", ",+".join(ROOT_CAPABILITIES))

# The sandbox's init: overlay the layered directories (upper layers from the bound layer
# directory, or from memory where that file system refuses), hide the layer directory, open
# /dev/shm to every user, say ready, then wait until killed or the lifetime ends.
_INIT = r"""
set -e
layers=/.tether-layers
for spec in "$@"; do
    name=${spec%%=*} dir=${spec#*=}
    opts=lowerdir=$dir,upperdir=$layers/$name/upper,workdir=$layers/$name/work
    if ! mount -t overlay overlay -o "$opts" "$dir" 2>/dev/null; then
        mount -t tmpfs -o mode=0755 tmpfs "$layers/$name"
        mkdir "$layers/$name/upper" "$layers/$name/work"
        mount -t overlay overlay -o "$opts" "$dir"
        echo "memory-layer $dir"
    fi
done
umount -l "$layers"
rmdir "$layers"
chmod 1777 /dev/shm
echo ready
exec sleep "$TETHER_SANDBOX_LIFETIME" </dev/null >/dev/null 2>&1
"""

_LAYER_MOUNT = "/.tether-layers"


class LocalSandboxUnavailable(RuntimeError):
    """This machine cannot run a LocalSandbox (no bwrap, not root, ...); the message says what to do."""


class ExecTimeout(TimeoutError):
    """A command ran past its `timeout`; its process group was killed. Keeps the output it wrote."""

    def __init__(self, cmd: str, timeout: float, stdout: str, stderr: str) -> None:
        self.cmd = cmd
        self.timeout = timeout
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"command ran past its {timeout}s timeout and was killed: {cmd[:200]}")


class _Capture:
    """One output stream, kept up to `limit` bytes; the rest is counted and dropped."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            room = len(chunk) if self.limit is None else max(0, self.limit - len(self.kept))
            self.kept += chunk[:room]
            self.dropped += len(chunk) - min(room, len(chunk))

    def text(self) -> str:
        out = self.kept.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[LocalSandbox: output truncated at {self.limit} bytes; {self.dropped} more bytes dropped]\n"
        return out


def default_base_dir() -> Path:
    """Where sandboxes' directories go: $TETHER_AGENT_SANDBOX_DIR, else <tmp>/tether-agent-sandboxes."""
    configured = os.environ.get(BASE_DIR_ENV, "").strip()
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "tether-agent-sandboxes"


def check_host() -> None:
    """Raise LocalSandboxUnavailable unless this machine can run LocalSandboxes."""
    if os.geteuid() != 0:
        raise LocalSandboxUnavailable(
            "LocalSandbox needs root (bwrap binds and overlay mounts, switching to sandbox users); "
            "run as root, or use E2B (SLIME_AGENT_SANDBOX_BACKEND=e2b)"
        )
    if shutil.which("bwrap") is None:
        raise LocalSandboxUnavailable(
            "LocalSandbox needs bubblewrap's `bwrap`, which is not on PATH: install it "
            "(apt-get install bubblewrap; dnf install bubblewrap)"
        )
    missing = [tool for tool in ("nsenter", "setpriv", "getent") if shutil.which(tool) is None]
    if missing:
        raise LocalSandboxUnavailable(
            f"LocalSandbox needs {', '.join(missing)} (util-linux, libc-bin), not found on PATH"
        )


def _is_under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


class LocalSandbox:
    """A sandbox on this machine: slime's `Sandbox` protocol over bubblewrap (see the module doc)."""

    def __init__(
        self,
        *,
        seed: str | Path | None = None,
        base_dir: str | Path | None = None,
        network: Literal["host", "none"] | None = None,
        output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES,
        lifetime_sec: float | None = None,
        private_dirs: Iterable[str] | None = None,
        layered_dirs: Iterable[str] = LAYERED_DIRS,
    ) -> None:
        self.seed = Path(seed) if seed is not None else None
        self.base_dir = Path(base_dir) if base_dir is not None else default_base_dir()
        chosen = network or os.environ.get(NETWORK_ENV, "").strip() or "host"
        if chosen not in ("host", "none"):
            raise ValueError(f"network must be 'host' or 'none' (from {NETWORK_ENV}?), not {chosen!r}")
        self.network = chosen
        self.output_limit_bytes = output_limit_bytes
        self.lifetime_sec = lifetime_sec
        if private_dirs is None:  # the defaults, and any the environment adds (colon-separated)
            extra = [d for d in os.environ.get(PRIVATE_DIRS_ENV, "").split(":") if d.strip()]
            private_dirs = (
                *PRIVATE_DIRS,
                *(d.strip().rstrip("/") for d in extra if d.strip() not in PRIVATE_DIRS),
            )
        self.private_dirs = tuple(private_dirs)
        self.layered_dirs = tuple(layered_dirs)
        for d in (*self.private_dirs, *self.layered_dirs):
            if not d.startswith("/") or d == "/" or ".." in Path(d).parts:
                raise ValueError(f"sandbox directories are absolute paths below /, not {d!r}")
        self.sandbox_id = ""
        self.dir: Path | None = None
        self.memory_layers: list[str] = []
        """Layered directories whose writes live in memory (overlayfs refused the disk there)."""
        self._init: asyncio.subprocess.Process | None = None
        self._init_pid = 0
        self._running: set[asyncio.subprocess.Process] = set()

    @property
    def ended(self) -> bool:
        """Whether the sandbox was started and has since ended (its lifetime ran out, or it was
        killed); its commands then raise RuntimeError."""
        return self._init is not None and self._init.returncode is not None

    # -- life -------------------------------------------------------------------------------

    async def __aenter__(self) -> LocalSandbox:
        check_host()
        self.sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        self.dir = self.base_dir / self.sandbox_id
        try:
            layered = await asyncio.to_thread(self._lay_out, self.dir)
            await self._start_init(self.dir, layered)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every process of the sandbox and remove its directory (idempotent)."""
        for proc in list(self._running):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        init, self._init = self._init, None
        if init is not None and init.returncode is None:
            # The init's death makes the kernel kill every process in the sandbox's PID namespace;
            # bwrap's outer process ends once they are all gone.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._init_pid or init.pid, signal.SIGKILL)
            try:
                async with asyncio.timeout(10):
                    await init.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init.pid, signal.SIGKILL)
                await init.wait()
        if self.dir is not None and self.dir.exists():
            await asyncio.to_thread(_remove_tree, self.dir)
        self.dir = None

    def _lay_out(self, sandbox_dir: Path) -> dict[str, str]:
        """Make the sandbox's directories on the host; return the layered ones as {layer name: path}."""
        if self.seed is not None and not self.seed.is_dir():
            raise FileNotFoundError(f"LocalSandbox seed {self.seed} is not a directory")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        base = self.base_dir.resolve()
        if any(_is_under(base, Path(d).resolve()) for d in self.layered_dirs):
            raise ValueError(
                f"the sandboxes' directory {base} must not lie in a layered directory {self.layered_dirs}"
            )
        for d in self.private_dirs:
            top = "/" + Path(d).parts[1]
            if any(_is_under(Path(d), Path(layer)) for layer in self.layered_dirs):
                raise ValueError(f"private directory {d} lies in a layered directory {self.layered_dirs}")
            if d != top and top not in self.private_dirs and os.path.lexists(top) and not Path(d).is_dir():
                raise ValueError(f"private directory {d} needs the host to have it: {top} is bound read-only")
        sandbox_dir.mkdir(mode=0o700)
        root = sandbox_dir / "root"
        root.mkdir(mode=0o755)
        for d in self.private_dirs:
            target = root / d.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            mode = 0o1777 if d in SHARED_SCRATCH_DIRS else 0o700 if d == "/root" else 0o755
            os.chmod(target, mode)
        layered: dict[str, str] = {}
        for d in self.layered_dirs:
            name = d.strip("/").replace("/", "_")
            if Path(d).is_dir():
                for part in ("upper", "work"):
                    (sandbox_dir / "layers" / name / part).mkdir(parents=True)
                layered[name] = d
            else:  # nothing of the host's to show: a plain directory of the sandbox
                (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (sandbox_dir / "layers").mkdir(exist_ok=True)
        if self.seed is not None:
            self._apply_seed(sandbox_dir, layered)
        return layered

    def _apply_seed(self, sandbox_dir: Path, layered: Mapping[str, str]) -> None:
        """Copy the seed tree over the sandbox's root (see `_seed_destination`)."""
        assert self.seed is not None
        for top, dirs, files in os.walk(self.seed):  # symlinked directories are copied as links
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                src = Path(top, name)
                dest = self._seed_destination(sandbox_dir, layered, Path("/", src.relative_to(self.seed)))
                if dest is None:
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.is_symlink():
                    os.symlink(os.readlink(src), dest)
                elif src.is_dir():
                    dest.mkdir(exist_ok=True)
                    shutil.copystat(src, dest)
                else:
                    shutil.copy2(src, dest)

    def _seed_destination(self, sandbox_dir: Path, layered: Mapping[str, str], path: Path) -> Path | None:
        """Where the seed's `path` goes on the host: a layered directory's upper layer, else the
        sandbox's root/ (private directories, paths the host lacks); None for a directory on the
        way to one of those (`/usr` of `/usr/local`). A path in a read-only host directory is
        refused."""
        for name, d in layered.items():
            if _is_under(path, Path(d)):
                return sandbox_dir / "layers" / name / "upper" / path.relative_to(d)
        own = [Path(d) for d in (*self.private_dirs, *self.layered_dirs)]
        if any(_is_under(path, d) for d in own) or not os.path.lexists(Path("/", path.parts[1])):
            return sandbox_dir / "root" / path.relative_to("/")
        if any(_is_under(d, path) for d in own):
            return None
        raise ValueError(
            f"seed {self.seed} holds {path}, inside the host's read-only /{path.parts[1]}: seed paths go "
            f"in {', '.join(self.private_dirs + self.layered_dirs)} or in top-level directories the host lacks"
        )

    def _bwrap_argv(self, sandbox_dir: Path, layered: Mapping[str, str], *, info_fd: int) -> list[str]:
        root = sandbox_dir / "root"
        private_top = {Path(d).parts[1] for d in self.private_dirs if len(Path(d).parts) == 2}
        argv = ["bwrap", "--bind", str(root), "/"]
        bound: list[Path] = []
        with os.scandir("/") as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = entry.name
                if name in HIDDEN_TOP_LEVEL or name in private_top:
                    continue
                if entry.is_symlink():
                    argv += ["--symlink", os.readlink(entry.path), f"/{name}"]
                else:
                    argv += ["--ro-bind", entry.path, f"/{name}"]
                    bound.append(Path(entry.path))
        argv += ["--dev", "/dev", "--proc", "/proc"]
        for d in self.private_dirs:
            if len(Path(d).parts) > 2 and Path(d).exists():  # nested (/var/tmp): bind over the host's
                argv += ["--bind", str(root / d.lstrip("/")), d]
        base = self.base_dir.resolve()
        if any(_is_under(base, b.resolve()) for b in bound) and base.exists():
            argv += ["--tmpfs", str(base)]  # the sandboxes' directories, seen through a read-only bind
        argv += ["--bind", str(sandbox_dir / "layers"), _LAYER_MOUNT]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", self.sandbox_id]
        if self.network == "none":
            argv.append("--unshare-net")
        argv += ["--die-with-parent", "--new-session", "--info-fd", str(info_fd)]
        argv += ["/bin/sh", "-c", _INIT, "tether-sandbox-init"]
        argv += [f"{name}={path}" for name, path in layered.items()]
        return argv

    async def _start_init(self, sandbox_dir: Path, layered: Mapping[str, str]) -> None:
        loop = asyncio.get_running_loop()
        info_read, info_write = os.pipe()
        info = asyncio.StreamReader()
        info_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(info), os.fdopen(info_read, "rb", buffering=0)
        )
        try:
            self._init = await asyncio.create_subprocess_exec(
                *self._bwrap_argv(sandbox_dir, layered, info_fd=info_write),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": _PATH, "TETHER_SANDBOX_LIFETIME": _lifetime_arg(self.lifetime_sec)},
                pass_fds=(info_write,),
                start_new_session=True,
            )
            os.close(info_write)
            info_write = -1
            async with asyncio.timeout(START_TIMEOUT_SEC):
                await self._await_ready(self._init)
                described = await _read_json_object(info)
                self._init_pid = int(str(described["child-pid"]))
        except TimeoutError:
            raise LocalSandboxUnavailable(
                f"LocalSandbox {self.sandbox_id} did not start within {START_TIMEOUT_SEC}s"
            ) from None
        finally:
            if info_write >= 0:
                os.close(info_write)
            info_transport.close()
        if self.memory_layers:
            logger.warning(
                "[agent.sandbox] %s: %s cannot hold an overlay upper layer; writes to %s live in memory",
                self.sandbox_id,
                self.base_dir,
                ", ".join(self.memory_layers),
            )

    async def _await_ready(self, init: asyncio.subprocess.Process) -> None:
        assert init.stdout is not None
        while True:
            line = (await init.stdout.readline()).decode(errors="replace").strip()
            if line == "ready":
                return
            if line.startswith("memory-layer "):
                self.memory_layers.append(line.split(" ", 1)[1])
            elif not line:  # the init ended before it was ready
                await init.wait()
                raise LocalSandboxUnavailable(
                    f"LocalSandbox {self.sandbox_id} failed to start (bwrap exit {init.returncode}): "
                    f"{await _read_rest(init.stderr)}"
                )

    # -- commands ---------------------------------------------------------------------------

    def _enter_argv(self, user: str, cmd: str) -> list[str]:
        if self._init is None or not self._init_pid:
            raise RuntimeError("LocalSandbox is not started: use it as `async with LocalSandbox() as sb:`")
        if self.ended:
            raise RuntimeError(
                f"LocalSandbox {self.sandbox_id} has ended (its lifetime_sec={self.lifetime_sec} ran out, or it was killed)"
            )
        return [
            "nsenter",
            f"--target={self._init_pid}",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--root",
            "--wd",
            "--",
            "/bin/sh",
            "-c",
            _ENTER,
            "tether-sandbox-enter",
            user,
            cmd,
        ]

    async def _run(
        self,
        cmd: str,
        *,
        user: str,
        env: Mapping[str, str] | None,
        timeout: float | None,  # noqa: ASYNC109  # slime's exec takes per-call timeouts
        stdin: IO[bytes] | bytes | None = None,
        limit: int | None,
    ) -> tuple[int, str, str]:
        full_env = {"PATH": _PATH, "LANG": "C.UTF-8", **(env or {})}
        proc = await asyncio.create_subprocess_exec(
            *self._enter_argv(user, cmd),
            stdin=asyncio.subprocess.PIPE
            if isinstance(stdin, bytes)
            else stdin or asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=full_env,
            start_new_session=True,  # its own process group: a timeout kills the command's whole tree
        )
        self._running.add(proc)
        out, err = _Capture(limit), _Capture(limit)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            asyncio.ensure_future(out.drain(proc.stdout)),
            asyncio.ensure_future(err.drain(proc.stderr)),
        ]
        try:
            if isinstance(stdin, bytes):
                assert proc.stdin is not None
                proc.stdin.write(stdin)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await proc.stdin.drain()
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                await _settle(readers)
                raise ExecTimeout(cmd, timeout or 0, out.text(), err.text()) from None
            await _settle(readers)
        finally:
            for reader in readers:
                reader.cancel()
            self._running.discard(proc)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, out.text(), err.text()

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,  # noqa: ASYNC109  # slime's Sandbox.exec signature
        check: bool = False,
        idempotent: bool = True,
    ) -> tuple[int, str, str]:
        """Run `cmd` with `bash -l -c` as `user`; (exit code, stdout, stderr).

        A command still running after `timeout` seconds has its process group killed and raises
        ExecTimeout. `check=True` raises RuntimeError on a non-zero exit. `idempotent` is a
        transport-retry hint; nothing here is retried."""
        code, out, err = await self._run(
            cmd, user=user, env=env, timeout=timeout or None, limit=self.output_limit_bytes
        )
        if check and code != 0:
            raise RuntimeError(f"sandbox exec failed (exit={code}): {cmd[:120]}\n{err[:400]}")
        return code, out, err

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        """Write `content` (text, bytes, or a host file's bytes) to `sandbox_path` as `user`,
        making parent directories; raises RuntimeError where the user may not write there."""
        parent = os.path.dirname(sandbox_path) or "/"
        cmd = f"mkdir -p -- {shlex.quote(parent)} && cat > {shlex.quote(sandbox_path)}"
        if isinstance(content, Path):
            with open(content, "rb") as fp:  # noqa: ASYNC230  # opens at once; cat streams it in
                code, _, err = await self._run(
                    cmd, user=user, env=None, timeout=None, stdin=fp, limit=1 << 16
                )
        else:
            data = content if isinstance(content, bytes) else str(content).encode()
            code, _, err = await self._run(cmd, user=user, env=None, timeout=None, stdin=data, limit=1 << 16)
        if code != 0:
            raise RuntimeError(
                f"sandbox write_file {sandbox_path} as {user} failed (exit={code}): {err[:400]}"
            )

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The text of `sandbox_path` read as `user`; "" where it cannot be read (as slime's E2B
        sandbox answers)."""
        code, out, _ = await self._run(
            f"cat -- {shlex.quote(sandbox_path)}", user=user, env=None, timeout=None, limit=None
        )
        return out if code == 0 else ""


def _lifetime_arg(lifetime_sec: float | None) -> str:
    return "infinity" if lifetime_sec is None or lifetime_sec <= 0 else f"{lifetime_sec:g}"


async def _settle(readers: Sequence[asyncio.Future[None]]) -> None:
    """Let the readers finish the output a command wrote; stop them if something it left behind
    keeps the pipes open."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_GRACE_SEC):
            await asyncio.gather(*readers)


async def _read_rest(stream: asyncio.StreamReader | None) -> str:
    if stream is None:
        return ""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_GRACE_SEC):
            return (await stream.read()).decode(errors="replace").strip()[-2000:]
    return ""


async def _read_json_object(stream: asyncio.StreamReader) -> dict[str, object]:
    """The first JSON object on `stream` (bwrap's --info-fd), read without waiting for EOF."""
    decoder = json.JSONDecoder()
    buf = ""
    while chunk := await stream.read(4096):
        buf += chunk.decode()
        try:
            obj, _ = decoder.raw_decode(buf.strip())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise LocalSandboxUnavailable(f"bwrap closed --info-fd before describing the sandbox: {buf!r}")


def _remove_tree(path: Path) -> None:
    """rmtree that also removes what a sandbox left unwritable (mode-000 overlay work dirs, 0500 dirs)."""

    def retry(func: object, failed: str, _exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            os.chmod(failed, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            shutil.rmtree(failed, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(failed)

    deadline = time.monotonic() + 5
    while path.exists():
        shutil.rmtree(path, onerror=retry)
        if not path.exists() or time.monotonic() > deadline:
            break
    if path.exists():
        logger.warning("[agent.sandbox] could not remove %s", path)

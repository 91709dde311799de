"""A real two-node SLURM cluster on this machine, for tests (see the `slurm_cluster` fixture).

munged (a fresh key), slurmctld and two slurmd, `node-a` and `node-b`, each slurmd in its own
UTS namespace so that jobs on it see its node name as their hostname. Everything listens on
127.0.0.1 only, on ports free when the cluster starts. `cred_expire=5` lets a requeued job start
again within seconds (SLURM's default holds it for two minutes).

Needs root (slurmd runs jobs as their users, unshare needs CAP_SYS_ADMIN) and Debian's packages:
`apt-get install slurmctld slurmd slurm-client munge`. Without them the fixture skips, saying what
is missing. Teardown cancels the cluster's jobs and stops the daemons it started, by their PIDs.

Test modules import the fixture by name: `from support.slurm_cluster import SlurmCluster, slurm_cluster`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from support.net import free_ports

NODES = ("node-a", "node-b")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
DAEMONS = ("slurmctld", "slurmd", "munged")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"
# The states a job does not leave (except by a requeue, which makes it PENDING again).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")

SLURM_CONF = """\
ClusterName=tethertest
SlurmctldHost={ctld_host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={port_a}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.socket.2,cred_expire=5
StateSaveLocation={base}/state/ctld
SlurmdSpoolDir={base}/state/slurmd-%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName={node_a} NodeHostname={node_a} NodeAddr=127.0.0.1 Port={port_a} CPUs=2 RealMemory={memory} State=UNKNOWN
NodeName={node_b} NodeHostname={node_b} NodeAddr=127.0.0.1 Port={port_b} CPUs=2 RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class ClusterUnavailable(Exception):
    """The cluster cannot run here (missing binaries, no root, a daemon that would not start)."""


def missing_requirements() -> str | None:
    """Why a cluster cannot start on this machine, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a SLURM test cluster needs root (slurmd, unshare --uts)"
    for name in DAEMONS:
        if shutil.which(name) is None:
            return f"{name} not installed: {INSTALL}"
    for name in CLIENTS:
        if shutil.which(name) is None:
            return f"{name} not installed: {INSTALL}"
    for name in ("unshare", "hostname"):
        if shutil.which(name) is None:
            return f"{name} not installed (util-linux, hostname)"
    return None


def parse_scontrol(line: str) -> dict[str, str]:
    """`scontrol show ... -o` output (KEY=VALUE pairs on one line; values may hold spaces) as a dict."""
    matches = list(_KEY.finditer(line))
    fields = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following is not None else len(line)
        fields[match.group(1)] = line[match.end() : end].strip()
    return fields


class SlurmCluster:
    """A running cluster: its configuration, its daemons, and helpers for jobs on it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "slurm.conf"
        self.nodes = NODES
        self.logs = base / "log"
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.munge_dir: Path | None = None

    # -- environment and commands ---------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment without any SLURM_* of its own, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def command(
        self, *argv: str, timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster."""
        done = subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def submit(
        self,
        script: Path,
        *args: str,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path,
    ) -> str:
        """`sbatch --parsable OPTIONS SCRIPT ARGS` from `cwd` with `env` added; returns the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"sbatch exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict (JobState, Restarts, NodeList, BatchHost, ...)."""
        return parse_scontrol(self.command("scontrol", "show", "job", "-o", job_id).stdout.strip())

    def wait_job(
        self,
        job_id: str,
        states: str | set[str],
        timeout: float,
        describe: Callable[[], str] = lambda: "",
        interval: float = 0.5,
    ) -> dict[str, str]:
        """Poll until the job is in one of `states`; fail on another final state or at the deadline.

        `describe` adds context (e.g. the job's output) to a failure.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            state = job.get("JobState", "")
            if state in wanted:
                return job
            if state in FINAL_STATES:
                raise AssertionError(f"job {job_id} ended {state}, not {sorted(wanted)}: {job}\n{describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {state} after {timeout:.0f}s (waiting for {sorted(wanted)}): "
                    f"{job}\n{describe()}"
                )
            time.sleep(interval)

    def scancel(self, job_id: str, *options: str) -> None:
        self.command("scancel", *options, job_id)

    def node_states(self) -> dict[str, str]:
        """Node name → its state as `sinfo` shows it (idle, alloc, down*, ...)."""
        out = self.command("sinfo", "--noheader", "--Node", "--format=%N %t", timeout=10).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def node_of(self, pid: int) -> str | None:
        """The node a process runs on: the one whose slurmd shares its UTS namespace (its hostname)."""
        try:
            uts = os.readlink(f"/proc/{pid}/ns/uts")
        except OSError:
            return None
        for node in self.nodes:
            daemon = self.daemons.get(f"slurmd-{node}")
            if daemon is not None and os.readlink(f"/proc/{daemon.pid}/ns/uts") == uts:
                return node
        return None

    def log_tails(self, chars: int = 2000) -> str:
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    # -- start and stop -------------------------------------------------------------------
    def start(self, timeout: float = 30) -> None:
        """Write the configuration and key, start the daemons, wait until both nodes are idle."""
        for sub in ("state/ctld", "run", "log", "key"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        # munged: the key readable by its owner only, in a private folder. The socket's folder
        # and every folder above it must let everyone through, which pytest's private temporary
        # folders do not: the socket gets a folder of its own under the system's.
        os.chmod(self.base / "key", 0o700)
        key = self.base / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_dir = Path(tempfile.mkdtemp(prefix="tether-munge-"))
        os.chmod(self.munge_dir, 0o755)
        socket_path = self.munge_dir / "munge.socket.2"
        if len(str(socket_path)) >= 100:
            raise ClusterUnavailable(f"the munge socket path is too long for AF_UNIX: {socket_path}")
        ctld_port, port_a, port_b = free_ports(3)
        total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.conf.write_text(
            SLURM_CONF.format(
                base=self.base,
                munge_dir=self.munge_dir,
                ctld_host=socket.gethostname().split(".")[0],
                ctld_port=ctld_port,
                port_a=port_a,
                port_b=port_b,
                node_a=NODES[0],
                node_b=NODES[1],
                memory=max(256, total_mb // 2 - 512),  # both nodes share this machine's memory
            )
        )
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={self.logs / 'munged.log'}",
                f"--pid-file={self.base / 'run' / 'munged.pid'}",
                f"--seed-file={self.base / 'run' / 'munged.seed'}",
            ],
        )
        self._wait(lambda: socket_path.exists(), timeout, "munged did not create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in NODES:
            # Its own UTS namespace: jobs on this node see `node` as their hostname.
            self._spawn(
                f"slurmd-{node}",
                [
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    'hostname "$1" && exec slurmd -D -N "$1" -f "$2"',
                    "sh",
                    node,
                    str(self.conf),
                ],
            )
        self._wait(lambda: all(self._idle(node) for node in NODES), timeout, "the nodes did not become idle")

    def _idle(self, node: str) -> bool:
        done = self.command("sinfo", "--noheader", "--Node", "--format=%N %t", timeout=10, check=False)
        if done.returncode != 0:
            return False  # slurmctld not answering yet
        states = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
        return states.get(node) == "idle"

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.logs / f"{name}.out", "ab") as out:
            self.daemons[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    out = (self.logs / f"{name}.out").read_text(errors="replace")[-1500:]
                    raise ClusterUnavailable(f"{name} exited {proc.returncode} at start:\n{out}")
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"{what} within {timeout:.0f}s\n{self.log_tails()}")
            time.sleep(0.1)

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job of this cluster (all of them are ours) and wait until none is left."""
        if self.daemons.get("slurmctld") is None or self.daemons["slurmctld"].poll() is not None:
            return
        jobs = self.command("squeue", "--noheader", "--format=%i", check=False).stdout.split()
        if not jobs:
            return
        self.command("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while self.command("squeue", "--noheader", "--format=%i", check=False).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        """Stop the daemons this object started (nodes first, munged last), by their PIDs.

        They are this process's children, so waiting reaps them: none lingers as a zombie of
        PID 1 still answering `kill -0` (as daemons started detached do for a while).
        """
        order = [f"slurmd-{node}" for node in NODES] + ["slurmctld", "munged"]
        for name in order:
            proc = self.daemons.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in order:
            proc = self.daemons.pop(name, None)
            if proc is None:
                continue
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A fresh two-node SLURM cluster for the module's tests; skips where it cannot run."""
    why = missing_requirements()
    if why is not None:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except ClusterUnavailable as exc:
        cluster.stop()
        pytest.skip(f"the SLURM test cluster did not start: {exc}")
    try:
        yield cluster
    finally:
        try:
            cluster.cancel_all()
        finally:
            cluster.stop()

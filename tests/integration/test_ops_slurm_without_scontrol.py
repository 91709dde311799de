"""bin/slurm/tether.sbatch where a real cluster cannot take it: a node without `scontrol`, and a
head that ends because a trainer node was lost.

Runs under real SLURM (sbatch, srun, scancel, requeue, the time-limit signal, where each process
runs) are tests/integration/test_ops_slurm_real.py. Every node of that cluster has `scontrol`, so the script's
fallback, python-hostlist expanding SLURM_JOB_NODELIST, is checked here: the script runs with a
PATH that holds only the tools it needs, a stand-in `srun` and a stand-in tether launcher that
records how it was called. No setting is given that has a default, so the defaults are checked
too (the real tests set the head's host and bind address to loopback ones). A head that exits
75 (a lost trainer node) gets the job requeued, as often as TETHER_NODE_LOSS_REQUEUES allows;
there the stand-in tether exits so, and a stand-in `scontrol` records the requeue.

"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import REPO

SCRIPT = REPO / "bin" / "slurm" / "tether.sbatch"
# What the script runs besides bash's builtins, scontrol and srun.
TOOLS = ("bash", "cat", "date", "grep", "mkdir", "od", "rm", "seq", "sleep", "tail", "tr")

FAKE_SRUN = """#!/usr/bin/env bash
# A stand-in for srun: records its arguments, runs the command once per --nodelist node with
# that node's SLURMD_NODENAME, and waits for them.
echo "srun $*" >> "$FAKE_LOG"
nodelist=""
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case "$1" in --nodelist=*) nodelist=${1#--nodelist=} ;; esac
  shift
done
IFS=, read -ra nodes <<< "$nodelist"
for node in "${nodes[@]}"; do SLURMD_NODENAME=$node "$@" & done
wait
"""

FAKE_TETHER = """#!/usr/bin/env bash
# A stand-in for the tether launcher. `run`: records its arguments and secret, publishes a head
# address, and waits (with a deadline) for the agents. `agent`: records the same and says so.
cmd=$1
shift
echo "$cmd $*" >> "$FAKE_LOG"
printf '%s' "$TETHER_SECRET" > "$FAKE_DIR/$cmd-${SLURMD_NODENAME}.secret"
case "$cmd" in
  run)
    run_dir=""; prev=""
    for arg in "$@"; do [ "$prev" = --run-dir ] && run_dir=$arg; prev=$arg; done
    echo "head node $TETHER_NODE_NAME" >> "$FAKE_LOG"
    printf 'tcp://0.0.0.0:4242' > "$run_dir/head_address"
    for _ in $(seq 1 200); do [ -e "$FAKE_DIR/agent-done" ] && exit "${FAKE_RUN_EXIT:-0}"; sleep 0.05; done
    echo "no agent within 10 s" >> "$FAKE_LOG"; exit 7 ;;
  agent)
    echo "agent env head=$TETHER_HEAD_ADDRESS" >> "$FAKE_LOG"
    : > "$FAKE_DIR/agent-done" ;;
esac
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# A stand-in for scontrol: the allocation's node names, and a requeue recorded.
case "$1" in
  show) printf 'node1\\nnode2\\n' ;;
  requeue) echo "scontrol $*" >> "$FAKE_LOG" ;;
esac
"""


def _fakes(tmp_path: Path, *, scontrol: bool = False) -> dict[str, str]:
    """A PATH of the script's tools and stand-ins (srun, and `scontrol` when asked), a stand-in
    tether launcher; the environment the script runs with."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not installed"
        (fakebin / tool).symlink_to(found)
    stand_ins = {"srun": FAKE_SRUN, **({"scontrol": FAKE_SCONTROL} if scontrol else {})}
    for name, text in stand_ins.items():
        (fakebin / name).write_text(text)
        (fakebin / name).chmod(0o755)
    launcher = tmp_path / "tether"
    launcher.write_text(FAKE_TETHER)
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TETHER"))}
    env.update(
        PATH=str(fakebin),  # nothing else: no scontrol unless it is the stand-in
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="node[1-2]",  # compressed, as SLURM writes it
        SLURMD_NODENAME="node1",
        SLURM_SUBMIT_DIR=str(tmp_path),
        TETHER=str(launcher),
        TETHER_PYTHON=sys.executable,  # the python with python-hostlist
        FAKE_LOG=str(tmp_path / "calls.log"),
        FAKE_DIR=str(tmp_path),
    )
    return env


def _sbatch(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--config", "run.yaml"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_lost_trainer_node_requeues_the_job_as_often_as_allowed(tmp_path: Path) -> None:
    """The head exits 75: requeued (it resumes with --auto-resume), counted in the run directory;
    past TETHER_NODE_LOSS_REQUEUES, not again."""
    env = {**_fakes(tmp_path, scontrol=True), "FAKE_RUN_EXIT": "75", "TETHER_NODE_LOSS_REQUEUES": "1"}
    first = _sbatch(tmp_path, env)
    assert first.returncode == 75, first.stderr
    assert "a trainer node was lost; requeueing job 77 (1/1)" in first.stderr, first.stderr
    assert (tmp_path / "runs" / "slurm-77" / "node_loss_requeues").read_text().strip() == "1"
    (tmp_path / "agent-done").unlink()
    again = _sbatch(tmp_path, env)  # the requeued job, on the same run directory
    assert "not requeueing: 1 requeues for lost nodes already" in again.stderr, again.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c for c in calls if c.startswith("scontrol")] == ["scontrol requeue 77"], calls


def test_sbatch_without_scontrol_expands_the_nodelist_with_hostlist(tmp_path: Path) -> None:
    env = _fakes(tmp_path)
    log = Path(env["FAKE_LOG"])
    done = _sbatch(tmp_path, env)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "slurm-77"  # the default: SLURM_SUBMIT_DIR/runs/slurm-JOB
    assert "job 77 (restart 0) on node1 node2; head on node1" in done.stderr, done.stderr

    calls = log.read_text().splitlines()
    head = f"--run-dir {run_dir} --save {run_dir}/checkpoints --auto-resume"
    # No bind address by default: the head binds its node's planned address, not every interface.
    assert calls[0] == f"run --config run.yaml {head} --head-port 0", calls
    assert calls[1] == "head node node1", calls
    sruns = [c for c in calls if c.startswith("srun ")]
    assert len(sruns) == 1, calls
    srun = sruns[0].split()
    assert {"--nodes=1", "--ntasks=1", "--nodelist=node2", "--overlap", "--export=ALL"} <= set(srun), srun
    # One agent, on node2 only, told the head's port at the batch node's name.
    agents = [c for c in calls if c.startswith("agent --")]
    assert agents == [f"agent --head tcp://node1:4242 --node-name node2 --run-dir {run_dir}"], calls
    assert "agent env head=tcp://node1:4242" in calls
    assert "requeue" not in done.stderr

    # One secret for the job, in the environment of the head and the agent, on no command line.
    secrets = {p.name: p.read_text() for p in tmp_path.glob("*.secret")}
    assert set(secrets) == {"run-node1.secret", "agent-node2.secret"}, secrets
    secret = secrets["run-node1.secret"]
    assert len(secret) == 64 and int(secret, 16) >= 0 and secrets["agent-node2.secret"] == secret
    assert not any(secret in c for c in calls)

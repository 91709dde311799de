"""Start a torchrun job of check scripts for the pytest side, and read back the ranks' results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def under_shim(cmd: list[str]) -> list[str]:
    """`cmd` under tether's shim, as the head starts torchrun: what the ranks leave behind when
    they end (Megatron's async-save writer spawns a multiprocessing manager that outlives a rank's
    os._exit) is killed with the job instead of lingering through the rest of the test run."""
    return [sys.executable, "-m", "tether.runtime.process.shim", "--parent-pid", str(os.getpid()), "--", *cmd]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 400, log: Path) -> int:
    """Run `torchrun --standalone` on a check script; returns the exit code, log written to `log`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / script),
        *args,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            under_shim(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the launcher we started, and its ranks
            proc.wait()
            raise


def results(path: Path) -> dict[str, Any]:
    """One rank's results; a failed check raises with its traceback."""
    return dict(json.loads(path.read_text()))


def value(data: dict[str, Any], key: str) -> Any:
    entry = data.get(key)
    assert entry is not None, f"check {key!r} did not run (see the torchrun log)"
    assert entry["ok"], f"check {key!r} failed:\n{entry['error']}"
    return entry["value"]


def make_batch(num_samples: int, seed: int, vocab: int = 320) -> Any:
    """A TrainBatch of random prompt+response tokens, every response token trainable."""
    import numpy as np

    from tether.train.rank.batching import TrainBatch, step_loss_weights

    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 7, num_samples)
    responses = rng.integers(3, 7, num_samples)
    lengths = prompts + responses
    offsets = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    r = int(responses.sum())
    batch = TrainBatch(
        tokens=rng.integers(0, vocab, int(lengths.sum())).astype(np.int32),
        offsets=offsets,
        response_lengths=responses.astype(np.int32),
        loss_masks=np.ones(r, dtype=np.uint8),
        rewards=np.zeros(num_samples, dtype=np.float32),
        raw_rewards=np.zeros(num_samples, dtype=np.float32),
        rollout_ids=np.arange(num_samples, dtype=np.int64),
        sample_indices=np.arange(num_samples, dtype=np.int64),
        group_indices=np.zeros(num_samples, dtype=np.int64),
        loss_weights=np.zeros(num_samples, dtype=np.float64),
    )
    batch.loss_weights = step_loss_weights(batch, per_rollout_loss_mean=False)
    batch.validate()
    return batch


def shard_and_plan(
    batch: Any, dp_size: int, dp_rank: int, micro_batch_size: int = 2
) -> tuple[Any, list[list[int]]]:
    """This DP rank's shard of the step and its micro-batch plan (what the head sends)."""
    from tether.train.rank.batching import plan_micro_batches, shard_for_data_parallel

    shards = shard_for_data_parallel(batch, dp_size)
    plan = plan_micro_batches(shards, micro_batch_size=micro_batch_size)
    return shards[dp_rank], plan[dp_rank]


def start_worker_job(
    address_dir: Path, secret_hex: str, log: Path, nproc: int = 2
) -> subprocess.Popen[bytes]:
    """Start `torchrun -m tether.train.rank.worker` (its own session, so the test can kill its group)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TETHER_SECRET=secret_hex)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tether.train.rank.worker",
        "--rpc-address-dir",
        str(address_dir),
    ]
    out = open(log, "wb")
    try:
        return subprocess.Popen(
            under_shim(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    finally:
        out.close()  # the child holds its own descriptor


def stop_job(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """Wait for a job we started; kill its process group if it does not end in time."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

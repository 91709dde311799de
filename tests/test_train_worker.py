"""The trainer worker under torchrun (2 ranks, PP=2), driven over RPC as the head drives it:
init, log-probs, SFT steps, export to HF, save and load, bad input, health while serving, shutdown."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from train_checks.launcher import make_batch, start_worker_job, stop_job

from tether.runtime.errors import RemoteError
from tether.runtime.rpc import ActorHandle, connect
from tether.runtime.secret import new_secret
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.worker import WorkerInfo, read_addresses

WORLD = 2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("worker_model") / "llama"
    subprocess.run([sys.executable, "-m", "tether", "init-model", "--out", str(out)], check=True, timeout=120)
    return out


async def _wait_addresses(directory: Path, proc: subprocess.Popen[bytes], log: Path) -> dict[int, str]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = read_addresses(directory, WORLD)
        if found is not None:
            return found
        if proc.poll() is not None:
            tail = (await asyncio.to_thread(log.read_text))[-4000:]
            raise AssertionError(f"worker job exited {proc.returncode}:\n{tail}")
        await asyncio.sleep(0.2)  # polling a directory with a deadline, not synchronising on time
    tail = (await asyncio.to_thread(log.read_text))[-4000:]
    raise AssertionError(f"ranks never wrote their addresses:\n{tail}")


async def _all(handles: list[ActorHandle], method: str, *args: Any, **kwargs: Any) -> list[Any]:
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(h.call(method, *args, timeout=300, **kwargs)) for h in handles]
    return [t.result() for t in tasks]


async def _drive(
    tmp: Path, model_dir: Path, proc: subprocess.Popen[bytes], secret: bytes, log: Path
) -> dict[str, Any]:
    addresses = await _wait_addresses(tmp / "addr", proc, log)
    handles = [await connect(addresses[r], secret, name=f"trainer-rank{r}", timeout=30) for r in range(WORLD)]
    out: dict[str, Any] = {}
    try:
        algo = AlgorithmConfig(loss_type="sft_loss", lr=3e-3)
        megatron = MegatronConfig(pipeline_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0)
        infos = await _all(handles, "init", str(model_dir), algo, megatron, result_type=WorkerInfo)
        out["infos"] = infos
        batch = make_batch(4, seed=3)
        plan = [[0, 1], [2, 3]]
        out["log_probs"] = await _all(handles, "compute_log_probs", batch, plan, with_entropy=True)
        out["losses"] = []
        for rollout_id in range(3):
            metrics = await _all(handles, "train", rollout_id, batch, plan)
            out["losses"].append([m["loss"] for m in metrics])
        out["health"] = [await h.call("health", result_type=WorkerInfo) for h in handles]
        out["export"] = await _all(handles, "export_hf", str(tmp / "hf_out"), 7)
        out["save"] = await _all(handles, "save", str(tmp / "ckpt"), 3, 3, 3, {"epoch": 0, "offset": 12})
        out["load"] = await _all(handles, "load", str(tmp / "ckpt"))
        bad = make_batch(4, seed=3)
        bad.offsets = bad.offsets[:-1]
        out["bad"] = []
        for h in handles:
            with pytest.raises(RemoteError) as err:
                await h.call("train", 9, bad, plan, timeout=60)
            out["bad"].append(str(err.value))
        out["health_after_bad"] = [await h.call("health", result_type=WorkerInfo) for h in handles]
        await _all(handles, "shutdown")
    finally:
        for h in handles:
            await h.close()
    return out


def test_worker_serves_the_head_protocol(tmp_path: Path, tiny_model: Path) -> None:
    secret = new_secret()
    log = tmp_path / "worker.log"
    proc = start_worker_job(tmp_path / "addr", secret.hex(), log)
    try:
        out = asyncio.run(_drive(tmp_path, tiny_model, proc, secret, log))
    finally:
        rc = stop_job(proc, timeout=60)
    assert rc == 0, log.read_text()[-4000:]

    infos = out["infos"]
    assert [(i.rank, i.pp_rank, i.pp_size, i.is_sync_source) for i in infos] == [
        (0, 0, 2, True),
        (1, 1, 2, True),
    ]
    lp = [r["log_probs"] for r in out["log_probs"]]
    assert lp[0].dtype == np.float32 and lp[0].shape == (int(make_batch(4, seed=3).response_lengths.sum()),)
    np.testing.assert_array_equal(lp[0], lp[1])  # broadcast from the last stage to every rank
    assert np.all(lp[0] < 0) and out["log_probs"][0]["entropy"] is not None
    losses = [step[0] for step in out["losses"]]
    assert all(step[0] == step[1] for step in out["losses"])
    assert losses[2] < losses[1] < losses[0]
    # SFT loss at step 0 is the mean NLL of the same tokens before the update.
    assert losses[0] == pytest.approx(-float(lp[0].mean()), rel=1e-5)
    assert [h.steps for h in out["health"]] == [3, 3]

    exported = Path(out["export"][0])
    assert out["export"][1] is None
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    with safe_open(str(tiny_model / "model.safetensors"), framework="np") as f:
        assert sorted(index["weight_map"]) == sorted(f.keys())
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()

    assert out["save"][0].endswith("iter_0000003")
    loaded = out["load"][0]
    assert {k: loaded[k] for k in ("step", "rollout_id", "weight_version", "data_position")} == {
        "step": 3,
        "rollout_id": 3,
        "weight_version": 3,
        "data_position": {"epoch": 0, "offset": 12},
    }
    assert loaded["path"].endswith("iter_0000003") and loaded["skipped"] == []
    assert all("offsets" in msg for msg in out["bad"])
    assert all(h.initialized and not h.busy for h in out["health_after_bad"])

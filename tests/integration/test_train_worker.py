"""The trainer worker under torchrun (2 ranks, PP=2), driven over RPC as the head drives it:
init, log-probs, SFT steps, export to HF, comparison with HF weights, save and load, bad input,
health while serving, shutdown."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from support.train_checks.launcher import make_batch, start_worker_job, stop_job

from tether.runtime.errors import RemoteError
from tether.runtime.rpc.actors import connect
from tether.runtime.rpc.secret import new_secret
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.rank.addresses import read_addresses
from tether.train.rank.protocol import (
    CompareHFRequest,
    ExportRequest,
    InitRequest,
    LoadRequest,
    LogProbsRequest,
    RankClient,
    SaveRequest,
    TrainRequest,
)

WORLD = 2


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


async def _all(ranks: list[RankClient], call: Callable[[RankClient], Coroutine[Any, Any, Any]]) -> list[Any]:
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(call(rank)) for rank in ranks]
    return [t.result() for t in tasks]


async def _drive(
    tmp: Path, model_dir: Path, proc: subprocess.Popen[bytes], secret: bytes, log: Path
) -> dict[str, Any]:
    addresses = await _wait_addresses(tmp / "addr", proc, log)
    ranks = [
        RankClient(await connect(addresses[r], secret, name=f"trainer-rank{r}", timeout=30), timeout=300)
        for r in range(WORLD)
    ]
    out: dict[str, Any] = {}
    try:
        algo = AlgorithmConfig(loss_type="sft_loss", lr=3e-3)
        megatron = MegatronConfig(
            pipeline_model_parallel_size=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            lr_decay_style="constant",
        )
        init = InitRequest(hf_checkpoint=str(model_dir), algorithm=algo, megatron=megatron)
        out["infos"] = await _all(ranks, lambda rank: rank.init(init))
        loaded = CompareHFRequest(hf_dir=str(model_dir))
        out["compare_loaded"] = await _all(ranks, lambda rank: rank.compare_hf(loaded))
        batch = make_batch(4, seed=3)
        plan = [[0, 1], [2, 3]]
        log_probs = LogProbsRequest(shard=batch, plan=plan, with_entropy=True)
        out["log_probs"] = await _all(ranks, lambda rank: rank.compute_log_probs(log_probs))
        out["losses"] = []
        for rollout_id in range(3):
            step = TrainRequest(rollout_id=rollout_id, shard=batch, plan=plan)
            results = await _all(ranks, lambda rank, step=step: rank.train(step))
            out["losses"].append([r.metrics["loss"] for r in results])
        out["health"] = [await rank.health() for rank in ranks]
        export = ExportRequest(out_dir=str(tmp / "hf_out"), version=7)
        out["export"] = await _all(ranks, lambda rank: rank.export_hf(export))
        exported = CompareHFRequest(hf_dir=out["export"][0].path)
        out["compare_exported"] = await _all(ranks, lambda rank: rank.compare_hf(exported))
        out["compare_trained"] = await _all(ranks, lambda rank: rank.compare_hf(loaded))
        save = SaveRequest(
            save_dir=str(tmp / "ckpt"),
            step=3,
            rollout_id=3,
            weight_version=3,
            data_position={"epoch": 0, "offset": 12},
        )
        out["save"] = await _all(ranks, lambda rank: rank.save(save))
        out["load"] = await _all(ranks, lambda rank: rank.load(LoadRequest(load_dir=str(tmp / "ckpt"))))
        bad = make_batch(4, seed=3)
        bad.offsets = bad.offsets[:-1]
        out["bad"] = []
        for rank in ranks:
            with pytest.raises(RemoteError) as err:
                await rank.train(TrainRequest(rollout_id=9, shard=bad, plan=plan))
            out["bad"].append(str(err.value))
        out["health_after_bad"] = [await rank.health() for rank in ranks]
        await _all(ranks, lambda rank: rank.shutdown())
    finally:
        for rank in ranks:
            await rank.close()
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
    lp = [r.log_probs for r in out["log_probs"]]
    assert lp[0].dtype == np.float32 and lp[0].shape == (int(make_batch(4, seed=3).response_lengths.sum()),)
    np.testing.assert_array_equal(lp[0], lp[1])  # broadcast from the last stage to every rank
    assert np.all(lp[0] < 0) and out["log_probs"][0].entropy is not None
    losses = [step[0] for step in out["losses"]]
    assert all(step[0] == step[1] for step in out["losses"])
    assert losses[2] < losses[1] < losses[0]
    # SFT loss at step 0 is the mean NLL of the same tokens before the update.
    assert losses[0] == pytest.approx(-float(lp[0].mean()), rel=1e-5)
    assert [h.steps for h in out["health"]] == [3, 3]

    exported = Path(out["export"][0].path)
    assert out["export"][1].path is None
    # Each stage's sync source compares its own layers: the loaded weights are --hf-checkpoint's,
    # the trained ones are those exported, and no longer the checkpoint's.
    for key in ("compare_loaded", "compare_exported"):
        assert [r.difference for r in out[key]] == [None, None], key
        assert all(r.compared > 0 for r in out[key]), key
    differences = [r.difference for r in out["compare_trained"]]
    assert all(d is not None and "values differ" in d for d in differences), differences
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    with safe_open(str(tiny_model / "model.safetensors"), framework="np") as f:
        assert sorted(index["weight_map"]) == sorted(f.keys())
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()

    assert out["save"][0].path.endswith("iter_0000003")
    loaded = out["load"][0]
    assert (loaded.step, loaded.rollout_id, loaded.weight_version, loaded.data_position) == (
        3,
        3,
        3,
        {"epoch": 0, "offset": 12},
    )
    assert loaded.path.endswith("iter_0000003") and loaded.skipped == []
    assert all("offsets" in msg for msg in out["bad"])
    assert all(h.initialized and not h.busy for h in out["health_after_bad"])

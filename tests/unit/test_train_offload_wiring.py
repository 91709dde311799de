"""--offload-train on a rank: the trainer's memory leaves after each weight update (the engines
generate next) and comes back before the next torch work, whatever that work is."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tether.train.rank.worker import TrainerWorker
from tether.train.state import offload

ACTOR = SimpleNamespace(chunks=[])  # no chunk: no pending parameter all-gather to land first


def run_worker(monkeypatch: pytest.MonkeyPatch, offload_train: bool) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr(offload, "offload_trainer", lambda a, r: calls.append(("offload", a, r)) or "moved")
    monkeypatch.setattr(offload, "onload_trainer", lambda state: calls.append(("onload", state)))

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            worker = TrainerWorker(pool)
            worker._actor, worker._offload_train = ACTOR, offload_train
            # The reference's and the OPD teacher's chunks leave the device with the actor.
            worker._ref = SimpleNamespace(chunks=["ref"])
            worker._teacher = SimpleNamespace(chunks=["teacher"])

            async def update(request: Any) -> None:
                calls.append("update")

            monkeypatch.setattr(worker, "_update_weights", update)
            await worker.update_weights(cast(Any, None))
            await worker._run(lambda: calls.append("train"))
            await worker._run(lambda: calls.append("log-probs"))

    asyncio.run(scenario())
    return calls


def test_offload_after_each_update_and_onload_before_the_next_work(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = run_worker(monkeypatch, offload_train=True)
    assert calls[0] == "update" and calls[2:] == [("onload", "moved"), "train", "log-probs"]
    what, actor, others = calls[1]
    assert (what, actor, others.chunks) == ("offload", ACTOR, ["ref", "teacher"])


def test_without_the_flag_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_worker(monkeypatch, offload_train=False) == ["update", "train", "log-probs"]

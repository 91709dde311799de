"""`tether status`: a run's state read from its records, printed, and bad input refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tether.commands import status as command
from tether.records.run_status import COLUMNS, from_records
from tether.runtime.errors import UserError
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_to_env


def _plan() -> dict[str, Any]:
    nodes = [
        {"index": 0, "hostname": "node-a", "address": "10.0.0.1"},
        {"index": 1, "hostname": "node-b", "address": "10.0.0.2"},
    ]
    engine = {"external": False, "address": "", "parts": [{"node": 0}]}
    return {
        "nodes": nodes,
        "engines": [{**engine, "index": 0}, {**engine, "index": 1, "parts": [{"node": 1}]}],
        "train_groups": [
            {
                "role": "actor",
                "nodes": [{"hostname": "node-a", "first_rank": 0, "nproc_per_node": 2, "node_rank": 0}],
            }
        ],
    }


def _run_dir(tmp_path: Path, events: list[dict[str, Any]], steps: int) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    receipt = {"plan": _plan(), "config": {"data": {"num_rollout": 10}}}
    (run / "receipt.json").write_text(json.dumps(receipt))
    lines = [json.dumps({"time": float(i), **e}) for i, e in enumerate(events)]
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    samples = [json.dumps({"step": s, "samples": []}) for s in range(steps)]
    (run / "samples.jsonl").write_text("\n".join(samples) + "\n")
    return run


LOST = [
    {"event": "start"},
    {"event": "engine_ready", "engine": "engine0"},
    {"event": "engine_ready", "engine": "engine1"},
    {"event": "ready"},
    {"event": "weight_sync", "version": 1},
    {"event": "node_lost", "node": "node-b", "reason": "3 heartbeat(s) in a row missed"},
    {"event": "engine_failed", "engine": "engine1"},
    {"event": "engine_lost", "engine": "engine1", "node": "node-b"},
    {"event": "weight_sync", "version": 2},
]


def test_a_lost_node_and_its_engine_from_the_records(tmp_path: Path) -> None:
    status = from_records(_run_dir(tmp_path, LOST, steps=2))
    assert (status.state, status.step, status.total, status.version) == ("running", 1, 10, 2)
    assert [(n.node, n.state) for n in status.nodes] == [("node-a", "up"), ("node-b", "lost")]
    assert [(e.engine, e.node, e.state, e.version) for e in status.engines] == [
        ("engine0", "node-a", "serving", 2),
        ("engine1", "node-b", "lost", None),
    ]
    assert [(r.group, r.node, r.ranks, r.state) for r in status.trainer] == [
        ("actor", "node-a", "0-1", "running")
    ]


def test_a_rejoined_engine_serves_its_catch_up_version_and_the_end_is_read(tmp_path: Path) -> None:
    events = [
        *LOST,
        {"event": "node_joined", "node": "node-b"},
        {"event": "engine_rejoined", "engine": "engine1", "version": 2},
        {"event": "weight_sync", "version": 3},
        {"event": "process_exit", "name": "trainer-node0"},
        {"event": "finished"},
    ]
    status = from_records(_run_dir(tmp_path, events, steps=3))
    assert status.state == "finished" and status.step == 2
    assert [n.state for n in status.nodes] == ["up", "up"]
    assert [(e.state, e.restarts) for e in status.engines] == [("exited", 0), ("exited", 0)]
    assert status.trainer[0].state == "exited"


def test_a_joined_node_and_its_engine_then_drained_from_the_records(tmp_path: Path) -> None:
    joined = [
        *LOST[:5],
        {"event": "node_joined", "node": "node-c", "address": "tcp://10.0.0.3:4000", "joined": True},
        {
            "event": "capacity_added",
            "node": "node-c",
            "address": "10.0.0.3",
            "engines": ["engine2"],
            "version": 1,
        },
        {"event": "weight_sync", "version": 2},
    ]
    status = from_records(_run_dir(tmp_path, joined, steps=2))
    assert [(n.node, n.address, n.state, n.joined) for n in status.nodes][-1] == (
        "node-c",
        "10.0.0.3",
        "up",
        True,
    )
    assert [(e.engine, e.node, e.state, e.version) for e in status.engines][-1] == (
        "engine2",
        "node-c",
        "serving",
        2,
    )
    assert "up (joined)" in command.render(status)
    drained = [
        *joined,
        {"event": "capacity_drained", "node": "node-c", "engines": ["engine2"], "requests": {"engine2": 5}},
        {"event": "node_drained", "node": "node-c", "engines": ["engine2"]},
        {"event": "stopped"},
    ]
    (tmp_path / "later").mkdir()
    status = from_records(_run_dir(tmp_path / "later", drained, steps=2))
    assert [(n.node, n.state) for n in status.nodes][-1] == ("node-c", "drained")
    assert [(e.engine, e.state, e.version) for e in status.engines] == [
        ("engine0", "exited", 2),
        ("engine1", "exited", 2),
        ("engine2", "drained", None),
    ]


def test_the_printed_tables_have_the_documented_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path, LOST, steps=2)
    (run / "head_address").write_text("tcp://127.0.0.1:1")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert command.main(argparse.Namespace(run_dir=run, json=False, timeout=1.0)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {run}: running (from the records view), 2 of 10 steps trained, weights v2")
    assert f"set {SECRET_ENV}" in out  # why there is no live view
    lines = out.splitlines()
    for table, columns in COLUMNS.items():
        assert lines[lines.index(table) + 1].split() == list(columns)
    assert "node-b  10.0.0.2  lost (3 heartbeat(s) in a row missed)" in lines


def test_a_live_head_that_does_not_answer_leaves_the_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path, LOST, steps=2)
    (run / "head_address").write_text("tcp://127.0.0.1:9")  # nothing serves there
    monkeypatch.setenv(SECRET_ENV, secret_to_env(new_secret()))
    assert command.main(argparse.Namespace(run_dir=run, json=True, timeout=0.5)) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["source"] == "records" and "did not answer" in shown["note"]


def test_bad_input_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a directory"):
        from_records(tmp_path / "missing")
    with pytest.raises(UserError, match="no receipt"):
        from_records(tmp_path)
    (tmp_path / "receipt.json").write_text("{}")
    with pytest.raises(UserError, match="not a tether receipt"):
        from_records(tmp_path)
    with pytest.raises(UserError, match="--timeout=0"):
        command.main(argparse.Namespace(run_dir=tmp_path, json=False, timeout=0))

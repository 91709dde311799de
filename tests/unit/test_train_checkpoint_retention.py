"""Checkpoint retention (--keep-last-checkpoints, --keep-every-checkpoints): what a prune deletes,
what it never deletes, crash-safe deletion, the flags' checks, and the head's events.

The checkpoints are real: `torch.distributed.checkpoint` files of one small tensor (written
without a process group) in the layout `train/checkpoint/load_save.py` saves, so `validate_checkpoint`
checks them as it checks a trainer's.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import shlex
import shutil
import warnings
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import REPO

from tether.config import help_text, resolve
from tether.records.retention import CheckpointRetention
from tether.records.run_dir import RunDir
from tether.runtime.errors import ConfigError
from tether.train.checkpoint import load_save as checkpoint
from tether.train.checkpoint import retention as checkpoint_retention
from tether.train.checkpoint.retention import (
    DeletedCheckpoint,
    kept_by_policy,
    prune_checkpoints,
    resolve_protected,
)


def _write(root: Path, step: int) -> Path:
    """A complete checkpoint as `checkpoint.save` leaves it, `latest` included."""
    d = root / checkpoint.iter_dir_name(step)
    model = d / checkpoint.MODEL_OPTIM
    with warnings.catch_warnings():
        # DCP notes that it runs without a process group; that is what this test wants.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=str(model), no_dist=True)
    (model / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    state = checkpoint.RunState(step=step, rollout_id=step, weight_version=step + 1)
    (d / checkpoint.RUN_STATE).write_bytes(msgspec.msgpack.encode(state))
    checkpoint.write_digests(d)
    (root / checkpoint.LATEST).write_text(str(step))
    return d


def _steps(root: Path, *steps: int) -> None:
    for step in steps:
        _write(root, step)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != checkpoint.LATEST)


def _deleted(root: Path, *steps: int) -> list[DeletedCheckpoint]:
    return [DeletedCheckpoint(root / checkpoint.iter_dir_name(s), s) for s in steps]


# -- the policy ---------------------------------------------------------------------------


def test_without_flags_every_checkpoint_is_kept(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3, 5, 7)
    assert prune_checkpoints(tmp_path, keep_last=None, keep_every=None) == []
    assert checkpoint.complete_checkpoints(tmp_path) == [1, 3, 5, 7]


def test_keep_last_keeps_the_newest_n_and_deletes_oldest_first(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3, 5, 7, 9)
    assert prune_checkpoints(tmp_path, keep_last=2, keep_every=None) == _deleted(tmp_path, 1, 3, 5)
    assert _names(tmp_path) == ["iter_0000007", "iter_0000009"]  # no `.deleting` left behind
    # Pruning again changes nothing; the next save makes the oldest kept one go.
    assert prune_checkpoints(tmp_path, keep_last=2, keep_every=None) == []
    _write(tmp_path, 11)
    assert prune_checkpoints(tmp_path, keep_last=2, keep_every=None) == _deleted(tmp_path, 7)


def test_keep_every_counts_steps_as_save_interval_does(tmp_path: Path) -> None:
    # --save-interval 10 saves after rollout ids 9, 19, ...: (S+1) % 10 == 0.
    _steps(tmp_path, 9, 19, 29, 39, 49)
    # Alone: iter_S with (S+1) % 20 == 0, plus the newest (49), whose (S+1) is not a multiple.
    assert prune_checkpoints(tmp_path, keep_last=None, keep_every=20) == _deleted(tmp_path, 9, 29)
    assert checkpoint.complete_checkpoints(tmp_path) == [19, 39, 49]


def test_keep_last_and_keep_every_together(tmp_path: Path) -> None:
    _steps(tmp_path, *range(9, 100, 10))
    deleted = prune_checkpoints(tmp_path, keep_last=2, keep_every=30)
    assert [d.step for d in deleted] == [9, 19, 39, 49, 69, 79]
    assert checkpoint.complete_checkpoints(tmp_path) == [29, 59, 89, 99]


def test_kept_by_policy() -> None:
    steps = [1, 3, 5, 7, 9, 11]
    assert kept_by_policy(steps, keep_last=None, keep_every=None) == set(steps)
    assert kept_by_policy(steps, keep_last=1, keep_every=None) == {11}
    assert kept_by_policy(steps, keep_last=10, keep_every=None) == set(steps)
    assert kept_by_policy(steps, keep_last=None, keep_every=4) == {3, 7, 11}
    assert kept_by_policy(steps, keep_last=2, keep_every=6) == {5, 9, 11}


# -- what is never deleted ------------------------------------------------------------------


def test_the_only_and_the_newest_complete_checkpoint_are_never_deleted(tmp_path: Path) -> None:
    _write(tmp_path, 4)
    assert prune_checkpoints(tmp_path, keep_last=None, keep_every=1000) == []
    assert checkpoint.complete_checkpoints(tmp_path) == [4]
    _write(tmp_path, 5)  # the policy keeps neither; the newest stays
    assert prune_checkpoints(tmp_path, keep_last=None, keep_every=1000) == _deleted(tmp_path, 4)
    assert checkpoint.complete_checkpoints(tmp_path) == [5]


def test_the_checkpoint_latest_names_and_all_newer_are_kept(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3, 5, 7)
    (tmp_path / checkpoint.LATEST).write_text("3")  # e.g. a crash between a rename and `latest`
    # A resume would load iter_3: it stays, and so does everything newer; only iter_1 goes.
    assert prune_checkpoints(tmp_path, keep_last=1, keep_every=None) == _deleted(tmp_path, 1)
    assert checkpoint.complete_checkpoints(tmp_path) == [3, 5, 7]


def test_protected_checkpoints_are_kept(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3, 5, 7)
    protected = {tmp_path / "iter_0000003"}
    assert prune_checkpoints(tmp_path, keep_last=1, keep_every=None, protected=protected) == _deleted(
        tmp_path, 1, 5
    )
    assert checkpoint.complete_checkpoints(tmp_path) == [3, 7]


def test_load_naming_the_save_dir_protects_the_checkpoint_of_the_start(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3)
    # Resolved at start (--load = --save): the checkpoint the run resumes from, iter_3.
    protected = resolve_protected([tmp_path, None, tmp_path / "absent"])
    assert tmp_path / "iter_0000003" in protected and tmp_path / "iter_0000001" not in protected
    _steps(tmp_path, 5, 7, 9)  # the run goes on saving into the same directory
    deleted = prune_checkpoints(tmp_path, keep_last=1, keep_every=None, protected=protected)
    assert deleted == _deleted(tmp_path, 1, 5, 7)
    assert checkpoint.complete_checkpoints(tmp_path) == [3, 9]


def test_a_save_in_progress_and_incomplete_directories_are_untouched(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3)
    tmp = tmp_path / "iter_0000005.tmp"
    (tmp / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    (tmp / checkpoint.MODEL_OPTIM / "__0_0.distcp").write_bytes(b"partial")
    incomplete = tmp_path / "iter_0000007"  # renamed into place by hand, no run state
    (incomplete / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    # The newer incomplete ones do not count: iter_3 is still the newest complete one and stays.
    assert prune_checkpoints(tmp_path, keep_last=1, keep_every=None) == _deleted(tmp_path, 1)
    assert _names(tmp_path) == ["iter_0000003", "iter_0000005.tmp", "iter_0000007"]
    assert (tmp / checkpoint.MODEL_OPTIM / "__0_0.distcp").read_bytes() == b"partial"


def test_nothing_is_deleted_before_a_newer_checkpoint_validates(tmp_path: Path) -> None:
    _steps(tmp_path, 1, 3, 5)
    shard = next((tmp_path / "iter_0000005" / checkpoint.MODEL_OPTIM).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # the newest is complete but truncated
    # A resume would fall back to iter_3, so iter_3 stays (and the damaged newest too).
    assert prune_checkpoints(tmp_path, keep_last=1, keep_every=None) == _deleted(tmp_path, 1)
    assert checkpoint.complete_checkpoints(tmp_path) == [3, 5]
    (tmp_path / "iter_0000003" / checkpoint.RUN_STATE).write_bytes(b"\xc1")  # now no checkpoint validates
    assert prune_checkpoints(tmp_path, keep_last=1, keep_every=None) == []
    assert checkpoint.complete_checkpoints(tmp_path) == [3, 5]


# -- crash-safe deletion --------------------------------------------------------------------


class _Crash(BaseException):
    """The process dying in the middle of an rmtree."""


def test_a_crash_during_deletion_leaves_nothing_loadable_and_the_next_prune_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _steps(tmp_path, 1, 3, 5)
    (tmp_path / checkpoint.LATEST).write_text("1")  # stale `latest`: must not resurrect a half-deleted one
    _write(tmp_path, 7)
    real_rmtree = shutil.rmtree

    def dies_half_way(path: str | Path, *args: object, **kwargs: object) -> None:
        real_rmtree(Path(path) / checkpoint.MODEL_OPTIM)  # part of the tree is gone, then the crash
        raise _Crash

    monkeypatch.setattr(checkpoint_retention.shutil, "rmtree", dies_half_way)
    with pytest.raises(_Crash):
        prune_checkpoints(tmp_path, keep_last=1, keep_every=None)
    monkeypatch.undo()
    # Every doomed checkpoint was renamed before any removal began: iter_1 half removed, iter_3
    # and iter_5 whole but renamed.
    assert _names(tmp_path) == [
        "iter_0000001.deleting",
        "iter_0000003.deleting",
        "iter_0000005.deleting",
        "iter_0000007",
    ]
    assert (tmp_path / "iter_0000003.deleting" / checkpoint.RUN_STATE).is_file()
    # No load considers them, even with `latest` naming one.
    (tmp_path / checkpoint.LATEST).write_text("3")
    assert checkpoint.complete_checkpoints(tmp_path) == [7]
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000007"
    assert checkpoint.checkpoint_candidates(tmp_path) == [tmp_path / "iter_0000007"]
    assert checkpoint.select_checkpoint(tmp_path) == (tmp_path / "iter_0000007", [])
    # The next prune (even with nothing else to delete) removes the leftovers and reports them.
    deleted = prune_checkpoints(tmp_path, keep_last=1, keep_every=None)
    assert deleted == [
        DeletedCheckpoint(tmp_path / checkpoint.iter_dir_name(s), s, interrupted=True) for s in (1, 3, 5)
    ]
    assert _names(tmp_path) == ["iter_0000007"]


# -- the flags ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save", "/ckpt", "--keep-last-checkpoints", "0"], "--keep-last-checkpoints=0: must be >= 1"),
        (["--save", "/ckpt", "--keep-last-checkpoints", "-2"], "--keep-last-checkpoints=-2: must be >= 1"),
        (["--save", "/ckpt", "--keep-every-checkpoints", "0"], "--keep-every-checkpoints=0: must be >= 1"),
        (["--keep-last-checkpoints", "3"], "--keep-last-checkpoints=3: needs --save"),
        (["--keep-every-checkpoints", "100"], "--keep-every-checkpoints=100: needs --save"),
        (
            ["--save", "/ckpt", "--save-interval", "20", "--keep-every-checkpoints", "50"],
            "--keep-every-checkpoints=50: must be a multiple of --save-interval=20",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(argv)
    assert str(info.value).startswith(message)


def test_flags_yaml_keys_and_help(tmp_path: Path) -> None:
    cfg = resolve(["--save", "/ckpt", "--save-interval", "20", "--keep-every-checkpoints", "100"])
    assert (cfg.algorithm.keep_last_checkpoints, cfg.algorithm.keep_every_checkpoints) == (None, 100)
    assert resolve([]).algorithm.keep_last_checkpoints is None  # default: keep all
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("save: /ckpt\nkeep_last_checkpoints: 3\n")
    assert resolve(["--config", str(yaml_file)]).algorithm.keep_last_checkpoints == 3
    text = help_text()
    assert "--keep-last-checkpoints" in text and "--keep-every-checkpoints" in text


# -- the head's side: a thread, events.jsonl ------------------------------------------------


def test_the_head_prunes_after_a_save_and_records_each_deletion(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _steps(save, 1, 3)
    cfg = resolve(["--save", str(save), "--load", str(save), "--keep-last-checkpoints", "1"])
    run_dir = RunDir(tmp_path / "run")
    retention = CheckpointRetention(cfg, run_dir)  # at start: --load resolves to iter_3
    _steps(save, 5, 7)
    deleted = asyncio.run(retention.prune())
    assert [d.step for d in deleted] == [1, 5]
    assert checkpoint.complete_checkpoints(save) == [3, 7]
    events = [json.loads(line) for line in run_dir.events_path.read_text().splitlines()]
    assert [(e["event"], e["path"], e["step"]) for e in events] == [
        ("checkpoint_deleted", str(save / "iter_0000001"), 1),
        ("checkpoint_deleted", str(save / "iter_0000005"), 5),
    ]


def test_the_ppo_critics_checkpoints_follow_the_actors_policy(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _steps(save, 1, 3, 5)
    _steps(save / "critic", 1, 3, 5)  # --save/critic/iter_N beside the actor's
    retention = CheckpointRetention(
        resolve(["--save", str(save), "--keep-last-checkpoints", "1"]), RunDir(tmp_path / "run")
    )
    deleted = asyncio.run(retention.prune())
    assert sorted((d.path.parent.name, d.step) for d in deleted) == [
        ("ckpt", 1), ("ckpt", 3), ("critic", 1), ("critic", 3)
    ]  # fmt: skip
    assert checkpoint.complete_checkpoints(save) == [5]
    assert checkpoint.complete_checkpoints(save / "critic") == [5]


def test_the_head_deletes_nothing_without_the_flags(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    _steps(save, 1, 3, 5)
    retention = CheckpointRetention(resolve(["--save", str(save)]), RunDir(tmp_path / "run"))
    assert asyncio.run(retention.prune()) == []
    assert checkpoint.complete_checkpoints(save) == [1, 3, 5]
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_the_systemd_unit_passes_retention_flags_that_parse() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string((REPO / "bin/systemd/tether@.service").read_text())
    service = unit["Service"]
    # systemd splits an unbraced $VAR at whitespace into arguments (none when it is empty).
    assert service["ExecStart"].split()[-1] == "$TETHER_RETENTION"
    env = dict(word.split("=", 1) for word in shlex.split(service["Environment"]))
    retention = env["TETHER_RETENTION"].split()
    cfg = resolve(["--save", "/ckpt", *retention])
    assert cfg.algorithm.keep_last_checkpoints == 3

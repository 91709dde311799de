"""--save-debug-train-data and --dump-details files, and --train-env-vars reaching the trainer processes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from tether.config import resolve
from tether.run.train_dump import DebugTrainDumpError, load_train_data, save_train_data
from tether.runtime.errors import ConfigError


class Shard(msgspec.Struct):
    tokens: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray | None = None
    note: int = 3


def test_round_trip_with_slime_placeholders(tmp_path: Path) -> None:
    a = Shard(tokens=np.arange(6, dtype=np.int32), rewards=np.array([0.5, 1.0], dtype=np.float32))
    b = Shard(
        tokens=np.arange(4, dtype=np.int32).reshape(2, 2),
        rewards=np.zeros(1, np.float32),
        advantages=np.ones(3),
    )
    path = save_train_data(str(tmp_path / "d" / "train_{rollout_id}_{rank}.msgpack"), 7, [[a, b]])
    assert path == tmp_path / "d" / "train_7_0.msgpack"
    dump = load_train_data(path)
    ((got_a, got_b),) = dump.steps
    assert dump.rollout_id == 7 and got_a["note"] == 3 and got_a["advantages"] is None
    assert got_a["tokens"].dtype == np.int32 and np.array_equal(got_a["tokens"], a.tokens)
    assert got_b["tokens"].shape == (2, 2) and np.array_equal(got_b["advantages"], np.ones(3))


def test_not_a_dump_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.msgpack"
    bad.write_bytes(msgspec.msgpack.encode({"format": "other"}))
    with pytest.raises(DebugTrainDumpError, match="not a tether train dump"):
        load_train_data(bad)


def test_dump_details_fills_slimes_layout() -> None:
    debug = resolve(["--dump-details", "/d/"]).debug
    assert debug.save_debug_rollout_data == "/d/rollout_data/{rollout_id}.msgpack"
    assert debug.save_debug_train_data == "/d/train_data/{rollout_id}.msgpack"
    own = resolve(["--dump-details", "/d", "--save-debug-train-data", "/t/{rollout_id}"]).debug
    assert own.save_debug_train_data == "/t/{rollout_id}"  # its own flag wins


def test_train_env_vars_reach_the_trainer_processes(tmp_path: Path) -> None:
    from support.plans import ONE_BOX, one_box_plan

    from tether.records.run_dir import RunDir
    from tether.run.trainer_pool import TrainerPool
    from tether.runtime.process.supervisor import LOCAL

    cfg = resolve(
        [
            "--train-env-vars",
            '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "2"}',
        ]
    )
    plan = one_box_plan(ONE_BOX)
    pool = TrainerPool(None, plan, cfg, RunDir(tmp_path / "run"), b"s" * 32, {0: LOCAL})  # type: ignore[arg-type]
    (node,) = plan.train_groups[0].nodes
    env = pool._spec(node).env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["OMP_NUM_THREADS"] == "2"  # the user's value over tether's default
    with pytest.raises(ConfigError, match=r"--train-env-vars=.*Expected `str`"):
        resolve(["--train-env-vars", '{"N": 3}'])

"""Saved rollouts replayed as slime replays them: --load-debug-rollout-data-subsample's rows, and
slime.rollout.forge_load.generate_rollout (--load-forge-rollout-data) reading tether's dumps."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest

from tether.config import resolve
from tether.rollout.debug_dump import DebugDumpError, save_rollout, subsample
from tether.rollout.sample import Sample
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from tether.runtime.errors import ConfigError


def rollout(groups: int, per_group: int, rollout_id: int = 0) -> list[list[Sample]]:
    return [
        [
            Sample(
                index=g * per_group + i, group_index=g, tokens=[1, 2, 3], response_length=1, reward=float(i)
            )
            for i in range(per_group)
        ]
        for g in range(groups)
    ]


def indices(groups: list[list[Sample]]) -> list[list[int]]:
    return [[s.index for s in g] for g in groups]


def test_subsample_keeps_slimes_rows_in_their_groups() -> None:
    data = rollout(4, 2)  # samples 0..7
    # k = 4: slime keeps data[:2] + data[-2:]
    assert indices(subsample(data, 0.5)) == [[0, 1], [6, 7]]
    # k = 5: data[:2] + data[-3:] (slime's -5 // 2 == -3), sample 5 alone in its group
    assert indices(subsample(data, 0.625)) == [[0, 1], [5], [6, 7]]
    assert indices(subsample(data, 1.0)) == indices(data)
    # k = 0: slime's data[:0] + data[-0:] is the whole rollout
    assert indices(subsample(data, 0.1)) == indices(data)


def test_subsample_flag_is_checked() -> None:
    cfg = resolve(
        [
            "--debug-train-only",
            "--load-debug-rollout-data",
            "d_{rollout_id}",
            "--load-debug-rollout-data-subsample",
            "0.5",
        ]
    )
    assert cfg.debug.load_debug_rollout_data_subsample == 0.5
    for argv in (
        ["--load-debug-rollout-data-subsample", "0.5"],
        ["--debug-train-only", "--load-debug-rollout-data", "d", "--load-debug-rollout-data-subsample", "0"],
    ):
        with pytest.raises(ConfigError) as err:
            resolve(argv)
        assert err.value.key == "--load-debug-rollout-data-subsample"


def test_forge_load_reads_dumps_with_slimes_fallbacks(tmp_path: Path) -> None:
    finder.install()
    forge = importlib.import_module("slime.rollout.forge_load")
    template = str(tmp_path / "{rollout_id}.msgpack")
    save_rollout(template, 0, rollout(2, 2))
    save_rollout(template, 1, rollout(1, 3))
    save_rollout(str(tmp_path / "eval_4.msgpack"), 4, rollout(1, 2))
    args = types.SimpleNamespace(load_forge_rollout_data=template, eval_reward_key=None, reward_key=None)

    def train(rollout_id: int) -> list[list[int]]:
        out = forge.generate_rollout(args, rollout_id, None)
        assert isinstance(out, RolloutFnTrainOutput)
        return indices(out.samples)

    assert train(1) == [[0, 1, 2]]
    assert train(7) == [[0, 1], [2, 3]]  # no file of its own: rollout 0's
    evaluated = forge.generate_rollout(args, 4, None, evaluation=True)
    assert isinstance(evaluated, RolloutFnEvalOutput)
    assert evaluated.data["forge_eval"]["rewards"] == [0.0, 1.0]
    assert forge.generate_rollout(args, 5, None, evaluation=True).data == {}
    # A literal file: every rollout trains on it; evaluations replay nothing.
    args.load_forge_rollout_data = str(tmp_path / "1.msgpack")
    assert train(9) == [[0, 1, 2]]
    assert forge.generate_rollout(args, 4, None, evaluation=True).data == {}
    args.load_forge_rollout_data = str(tmp_path / "none_{rollout_id}.msgpack")
    with pytest.raises(DebugDumpError, match="no dump for rollout 3 and none for rollout 0"):
        train(3)
    (tmp_path / "slime.pt").write_bytes(b"\x80\x04pickle")
    args.load_forge_rollout_data = str(tmp_path / "slime.pt")
    with pytest.raises(DebugDumpError, match=r"slime\.pt: not a tether rollout dump"):
        train(0)


def test_forge_flags_go_together() -> None:
    forge = "slime.rollout.forge_load.generate_rollout"
    cfg = resolve(["--rollout-function-path", forge, "--load-forge-rollout-data", "d/{rollout_id}.msgpack"])
    assert cfg.debug.load_forge_rollout_data == "d/{rollout_id}.msgpack"
    for argv in (
        ["--load-forge-rollout-data", "d"],
        ["--rollout-function-path", forge],
        [
            "--rollout-function-path",
            forge,
            "--load-forge-rollout-data",
            "d",
            "--load-debug-rollout-data",
            "d",
        ],
    ):
        with pytest.raises(ConfigError) as err:
            resolve(argv)
        assert err.value.key == "--load-forge-rollout-data"

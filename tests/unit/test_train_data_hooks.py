"""slime's train-data hooks on tether's rollout → train path: --custom-reward-post-process-path,
--custom-advantage-function-path and --disable-compute-advantages-and-returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.rollout import make_config
from test_train_rank_work import groups

from tether.config import Config
from tether.run.train_data_hooks import check_train_data_hooks, load_train_data_hooks
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks, TrainHookError
from tether.train.rank.work import WorkOptions, rollout_steps

HOOKS = """
import torch
from slime.utils.types import Sample
calls, positions = [], []
def rewards(args, samples):
    assert all(isinstance(s, Sample) for s in samples)
    raw = [s.get_reward_value(args) for s in samples]
    return raw, [10.0 * r + s.index for r, s in zip(raw, samples)]
def wrong_length(args, samples):
    return [0.0], [0.0]
def advantages(args, rollout_data):
    calls.append(sorted(k for k, v in rollout_data.items() if v is not None))
    raw = rollout_data["raw_reward"]  # the rollout's: `partition` indexes it, as in slime
    assert [raw[p] for p in rollout_data["partition"]] == rollout_data["local_raw_reward"]
    positions.append(list(rollout_data["partition"]))
    rollout_data["advantages"] = [torch.full((n,), float(r)) for n, r in zip(rollout_data["response_lengths"], rollout_data["rewards"])]
    rollout_data["returns"] = rollout_data["advantages"]
def no_returns(args, rollout_data):
    rollout_data["advantages"] = [torch.zeros(n) for n in rollout_data["response_lengths"]]
def three(args, rollout_data, extra):
    return None
"""


def _hooks(tmp_path: Path, algorithm: AlgorithmConfig) -> TrainDataHooks:
    hooks = load_train_data_hooks(
        Config(rollout=make_config().rollout, data=make_config().data, algorithm=algorithm)
    )
    assert hooks is not None
    return hooks


@pytest.fixture
def module(tmp_path: Path) -> Path:
    path = tmp_path / "train_hooks.py"
    path.write_text(HOOKS)
    return path


def test_reward_post_process_replaces_group_normalisation(tmp_path: Path, module: Path) -> None:
    algorithm = AlgorithmConfig(
        custom_reward_post_process_path=f"{module}:rewards", normalize_advantages=False
    )
    hooks = _hooks(tmp_path, algorithm)
    (step,) = rollout_steps(groups(2), algorithm, WorkOptions(global_batch_size=4), dp_size=1, hooks=hooks)
    shard = step.shards[0]
    order = np.argsort(shard.sample_indices)
    assert shard.raw_rewards[order].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert shard.rewards[order].tolist() == [0.0, 11.0, 2.0, 13.0]  # the hook's, not group-normalised


def test_reward_post_process_of_the_wrong_length_is_refused(tmp_path: Path, module: Path) -> None:
    algorithm = AlgorithmConfig(custom_reward_post_process_path=f"{module}:wrong_length")
    with pytest.raises(TrainHookError, match=r"raw_rewards must be 4 finite numbers"):
        rollout_steps(
            groups(2),
            algorithm,
            WorkOptions(global_batch_size=4),
            dp_size=1,
            hooks=_hooks(tmp_path, algorithm),
        )


@pytest.mark.parametrize("normalize", [False, True])
def test_custom_advantages_then_slimes_whitening(tmp_path: Path, module: Path, normalize: bool) -> None:
    algorithm = AlgorithmConfig(
        custom_advantage_function_path=f"{module}:advantages", normalize_advantages=normalize
    )
    hooks = _hooks(tmp_path, algorithm)
    (step,) = rollout_steps(groups(2), algorithm, WorkOptions(global_batch_size=4), dp_size=1, hooks=hooks)
    shard = step.shards[0]
    lengths = shard.response_lengths.tolist()
    expected = np.concatenate([np.full(n, r) for n, r in zip(lengths, shard.rewards.tolist(), strict=True)])
    if normalize:
        expected = (expected - expected.mean()) / np.sqrt(expected.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(shard.advantages, expected, rtol=1e-5, atol=1e-6)
    import sys

    seen = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(module)).calls[-1]
    assert {"tokens", "rewards", "loss_masks", "kl", "response_lengths", "total_lengths", "partition"} <= set(
        seen
    )


def test_custom_advantages_without_returns_are_refused(tmp_path: Path, module: Path) -> None:
    algorithm = AlgorithmConfig(custom_advantage_function_path=f"{module}:no_returns")
    with pytest.raises(TrainHookError, match=r"rollout_data\['returns'\]"):
        rollout_steps(
            groups(2),
            algorithm,
            WorkOptions(global_batch_size=4),
            dp_size=1,
            hooks=_hooks(tmp_path, algorithm),
        )


def test_disable_compute_advantages_and_returns() -> None:
    algorithm = AlgorithmConfig(
        loss_type="custom_loss",
        custom_loss_function_path="m.f",
        disable_compute_advantages_and_returns=True,
        kl_coef=0.1,
    )
    steps = rollout_steps(groups(4), algorithm, WorkOptions(global_batch_size=4), dp_size=1)
    assert all(s.log_prob_models == () and s.shards[0].advantages is None for s in steps)
    with pytest.raises(ConfigError, match="--disable-compute-advantages-and-returns"):
        AlgorithmConfig(disable_compute_advantages_and_returns=True)


def test_plan_checks_the_hooks_signatures(module: Path) -> None:
    check_train_data_hooks(AlgorithmConfig(custom_advantage_function_path=f"{module}:advantages"))
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(args, rollout_data\)"):
        check_train_data_hooks(AlgorithmConfig(custom_advantage_function_path=f"{module}:three"))


def test_custom_advantages_see_each_samples_place_in_the_rollout(tmp_path: Path, module: Path) -> None:
    # Two optimizer steps of one rollout: each step's hook call gets slime's `partition`, the
    # samples' positions in the whole rollout, which index the rollout's `raw_reward` (the hook
    # itself checks raw_reward[partition[i]] == local_raw_reward[i]).
    algorithm = AlgorithmConfig(custom_advantage_function_path=f"{module}:advantages")
    hooks = _hooks(tmp_path, algorithm)
    steps = rollout_steps(groups(2), algorithm, WorkOptions(global_batch_size=2), dp_size=1, hooks=hooks)
    assert len(steps) == 2
    import sys

    hook_module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(module))
    assert hook_module.positions[-2:] == [[0, 1], [2, 3]]
    assert [s.shards[0].positions.tolist() for s in steps] == [[0, 1], [2, 3]]

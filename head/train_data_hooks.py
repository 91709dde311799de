"""Loading and checking slime's train-data hooks (--custom-reward-post-process-path,
--custom-advantage-function-path) for `tether.train.train_data_hooks`, which runs them: each is
bound to the run's `args`, and one written against slime's API gets slime's Samples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.config import Config
from tether.rollout.hook_checks import HookCall, check_hook
from tether.rollout.hooks import flat_args, load_function, slime_samples
from tether.rollout.sample import Sample
from tether.rollout.slime_api.convert import uses_slime_api
from tether.train.config import AlgorithmConfig
from tether.train.train_data_hooks import TrainDataHooks

REWARD_POST_PROCESS = HookCall(
    "--custom-reward-post-process-path", "fn(args, samples)", ("args", "samples"), plain=True
)
ADVANTAGE = HookCall(
    "--custom-advantage-function-path", "fn(args, rollout_data)", ("args", "rollout_data"), plain=True
)


def check_train_data_hooks(algorithm: AlgorithmConfig) -> None:
    """`tether plan`/`run`, before anything starts: each hook imports and takes its call."""
    for path, spec in (
        (algorithm.custom_reward_post_process_path, REWARD_POST_PROCESS),
        (algorithm.custom_advantage_function_path, ADVANTAGE),
    ):
        if path is not None:
            check_hook(path, spec)


def load_train_data_hooks(config: Config) -> TrainDataHooks | None:
    """The hooks the run's flags name, bound to its `args`; None when it names none."""
    algorithm = config.algorithm
    reward_path, advantage_path = (
        algorithm.custom_reward_post_process_path,
        algorithm.custom_advantage_function_path,
    )
    if reward_path is None and advantage_path is None:
        return None
    args = flat_args(config)
    reward = None
    if reward_path is not None:
        reward_fn = load_function(reward_path, REWARD_POST_PROCESS.flag)
        slime = uses_slime_api(reward_fn)

        def reward(samples: Sequence[Sample]) -> Any:
            return reward_fn(args, slime_samples(samples) if slime else list(samples))

    advantage = None
    if advantage_path is not None:
        advantage_fn = load_function(advantage_path, ADVANTAGE.flag)

        def advantage(rollout_data: dict[str, Any]) -> Any:
            return advantage_fn(args, rollout_data)

    return TrainDataHooks(
        reward_post_process=reward,
        reward_post_process_path=reward_path or "",
        advantage=advantage,
        advantage_path=advantage_path or "",
    )

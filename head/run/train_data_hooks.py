"""Loading and checking slime's train-data hooks (--custom-reward-post-process-path,
--custom-advantage-function-path, --custom-convert-samples-to-train-data-path,
--rollout-data-postprocess-path) for `tether.train.data.hooks`, which runs them: each is
bound to the run's `args`, and one written against slime's API gets slime's Samples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tether.checks.loss_hooks import check_loss_hooks
from tether.checks.megatron_hooks import check_megatron_hooks
from tether.config import Config
from tether.rollout.hooks.calls import FlatArgs, keep_slime_changes, load_function, slime_samples
from tether.rollout.hooks.checks import HookCall, check_hook
from tether.rollout.sample import Sample
from tether.rollout.slime_api.args import custom_config_extras
from tether.rollout.slime_api.convert import uses_slime_api
from tether.train.config import AlgorithmConfig

if TYPE_CHECKING:
    from tether.train.data.hooks import TrainDataHooks

REWARD_POST_PROCESS = HookCall(
    "--custom-reward-post-process-path", "fn(args, samples)", ("args", "samples"), plain=True
)
ADVANTAGE = HookCall(
    "--custom-advantage-function-path", "fn(args, rollout_data)", ("args", "rollout_data"), plain=True
)
CONVERT_SAMPLES = HookCall(
    "--custom-convert-samples-to-train-data-path", "fn(args, samples)", ("args", "samples"), plain=True
)
ROLLOUT_DATA_POSTPROCESS = HookCall(
    "--rollout-data-postprocess-path",
    "fn(args, rollout_id, rollout_data)",
    ("args", "rollout_id", "rollout_data"),
    plain=True,
)


def check_train_data_hooks(algorithm: AlgorithmConfig) -> None:
    """`tether plan`/`run`, before anything starts: each hook imports and takes its call."""
    for path, spec in (
        (algorithm.custom_reward_post_process_path, REWARD_POST_PROCESS),
        (algorithm.custom_advantage_function_path, ADVANTAGE),
        (algorithm.custom_convert_samples_to_train_data_path, CONVERT_SAMPLES),
        (algorithm.rollout_data_postprocess_path, ROLLOUT_DATA_POSTPROCESS),
    ):
        if path is not None:
            check_hook(path, spec)
    check_loss_hooks(algorithm)  # the trainer ranks' hooks too (--custom-tis-function-path, ...)
    check_megatron_hooks(algorithm)  # and slime's Megatron hooks (--custom-megatron-init-path, ...)


def load_train_data_hooks(config: Config) -> TrainDataHooks | None:
    """The hooks the run's flags name, bound to its `args`; None when it names none."""
    algorithm = config.algorithm
    reward_path, advantage_path = (
        algorithm.custom_reward_post_process_path,
        algorithm.custom_advantage_function_path,
    )
    convert_path = algorithm.custom_convert_samples_to_train_data_path
    postprocess_path = algorithm.rollout_data_postprocess_path
    if reward_path is None and advantage_path is None and convert_path is None and postprocess_path is None:
        return None
    args = FlatArgs(config, extra=custom_config_extras(config))  # --custom-config-path's keys too
    reward = None
    if reward_path is not None:
        reward_fn = load_function(reward_path, REWARD_POST_PROCESS.flag)
        slime = uses_slime_api(reward_fn)
        hook_path: str = reward_path

        def reward(samples: Sequence[Sample]) -> Any:
            if not slime:
                return reward_fn(args, list(samples))
            given = slime_samples(samples)
            result = reward_fn(args, given)
            # What it set on slime's Samples (teacher_log_probs for on-policy distillation) stays.
            keep_slime_changes(hook_path, given, samples)
            return result

    advantage = None
    if advantage_path is not None:
        advantage_fn = load_function(advantage_path, ADVANTAGE.flag)

        def advantage(rollout_data: dict[str, Any]) -> Any:
            return advantage_fn(args, rollout_data)

    convert = None
    if convert_path is not None:
        convert_fn = load_function(convert_path, CONVERT_SAMPLES.flag)
        convert_slime = uses_slime_api(convert_fn)

        def convert(samples: Sequence[Sample]) -> Any:
            return convert_fn(args, slime_samples(samples) if convert_slime else list(samples))

    postprocess = None
    if postprocess_path is not None:
        postprocess_fn = load_function(postprocess_path, ROLLOUT_DATA_POSTPROCESS.flag)

        def postprocess(rollout_id: int, rollout_data: dict[str, Any]) -> Any:
            return postprocess_fn(args, rollout_id, rollout_data)

    from tether.train.data.hooks import TrainDataHooks  # numpy: after the run's processes start

    return TrainDataHooks(
        reward_post_process=reward,
        reward_post_process_path=reward_path or "",
        advantage=advantage,
        advantage_path=advantage_path or "",
        convert_samples=convert,
        convert_samples_path=convert_path or "",
        rollout_data_postprocess=postprocess,
        rollout_data_postprocess_path=postprocess_path or "",
    )

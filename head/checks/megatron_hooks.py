"""`tether plan`/`run`, before anything starts: slime's Megatron hooks (--custom-model-provider-path,
--custom-megatron-init-path, --custom-megatron-before-log-prob-hook-path,
--custom-megatron-before-train-step-hook-path) import and take the call the trainer ranks make
(tether.train.rank.megatron_hooks, tether.train.model.custom_provider)."""

from __future__ import annotations

from tether.rollout.hooks.checks import HookCall, check_hook
from tether.train.config import AlgorithmConfig

MODEL_PROVIDER = HookCall(
    "--custom-model-provider-path",
    "fn(pre_process=, post_process=[, vp_stage=None][, config=])",
    (),
    ("pre_process", "post_process"),
    plain=True,
)
INIT = HookCall("--custom-megatron-init-path", "fn(args)", ("args",), plain=True)
BEFORE_LOG_PROB = HookCall(
    "--custom-megatron-before-log-prob-hook-path",
    "fn(args, model, store_prefix)",
    ("args", "model", "store_prefix"),
    plain=True,
)
BEFORE_TRAIN_STEP = HookCall(
    "--custom-megatron-before-train-step-hook-path",
    "fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)",
    ("args", "rollout_id", "step_id", "model", "optimizer", "opt_param_scheduler"),
    plain=True,
)


def check_megatron_hooks(algorithm: AlgorithmConfig) -> None:
    """Each Megatron hook the flags name imports and takes its call; ConfigError naming the flag."""
    for path, spec in (
        (algorithm.custom_model_provider_path, MODEL_PROVIDER),
        (algorithm.custom_megatron_init_path, INIT),
        (algorithm.custom_megatron_before_log_prob_hook_path, BEFORE_LOG_PROB),
        (algorithm.custom_megatron_before_train_step_hook_path, BEFORE_TRAIN_STEP),
    ):
        if path is not None:
            check_hook(path, spec)


__all__ = ["check_megatron_hooks"]

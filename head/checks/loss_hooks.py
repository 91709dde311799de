"""`tether plan`/`run`, before anything starts: slime's loss-side hooks (--custom-tis-function-path,
--custom-pg-loss-reducer-function-path) import and take the call the trainer ranks will make
(tether.train.algorithms.loss_hooks); --custom-config-path reads as a mapping."""

from __future__ import annotations

from tether.rollout.hooks.checks import HookCall, check_hook
from tether.runtime.custom_config import read_custom_config
from tether.train.config import AlgorithmConfig


def hook_calls() -> tuple[HookCall, HookCall]:
    """The calls the ranks make of the TIS hook and the pg-loss reducer. Built on use: their
    names live beside the losses, whose module imports torch (~1.5 s of every `tether run`'s
    start-up before anything starts, for runs that name neither hook)."""
    from tether.train.algorithms.loss_hooks import REDUCER_POSITIONAL, TIS_KEYWORDS
    from tether.train.algorithms.losses import REDUCER_FLAG, TIS_FLAG

    tis = HookCall(
        TIS_FLAG,
        "fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=, response_lengths=)",
        (),
        TIS_KEYWORDS,
        plain=True,
    )
    reducer = HookCall(
        REDUCER_FLAG,
        "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)",
        REDUCER_POSITIONAL,
        plain=True,
    )
    return tis, reducer


def check_loss_hooks(algorithm: AlgorithmConfig) -> None:
    """Each loss hook the algorithm names imports and takes its call; raises ConfigError naming the flag."""
    if algorithm.custom_config_path is not None:
        read_custom_config(algorithm.custom_config_path)
    paths = (algorithm.custom_tis_function_path, algorithm.custom_pg_loss_reducer_function_path)
    if all(path is None for path in paths):
        return
    for path, spec in zip(paths, hook_calls(), strict=True):
        if path is not None:
            check_hook(path, spec)

"""slime's loss-side hooks on a trainer rank: --custom-tis-function-path and
--custom-pg-loss-reducer-function-path, loaded once per rank and called by `tether.train.algorithms.losses`
exactly as slime's policy loss calls them:

    --custom-tis-function-path   fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=,
                                    total_lengths=, response_lengths=)
                                 -> (pg_loss, modified_response_masks, metrics)
    --custom-pg-loss-reducer-function-path
                                 fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)
                                 -> reducer; reducer(pg_loss) -> scalar

The per-sample arguments are lists of 1-D tensors (one per sample of the micro-batch). `args` is a
namespace with slime's names for the algorithm's flags (`args.use_tis`, `args.tis_clip`,
`args.eps_clip_high` resolved, `args.calculate_per_token_loss`) and every key of
--custom-config-path's YAML (slime's examples/train_infer_mismatch_helper/mis.yaml: `args.tis_mode`,
...). Hook files written against slime import `slime.*` (mis.py imports slime's CP helpers): the
rank installs tether's slime API finder first, as the head does for rollout hooks.

`tether plan` checks both paths and their signatures before anything starts
(tether.run.train_data_hooks.check_train_data_hooks).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from tether.rollout.hooks.loader import load_function
from tether.runtime.custom_config import hook_extras
from tether.train.algorithms.losses import REDUCER_FLAG, TIS_FLAG, LossHooks
from tether.train.config import AlgorithmConfig

TIS_KEYWORDS = (
    "args",
    "pg_loss",
    "train_log_probs",
    "rollout_log_probs",
    "loss_masks",
    "total_lengths",
    "response_lengths",
)
"""The keyword arguments slime's policy loss calls a TIS function with."""
REDUCER_POSITIONAL = ("total_lengths", "response_lengths", "loss_masks", "calculate_per_token_loss")
"""The positional arguments slime calls a pg-loss reducer factory with."""


def import_hook(path: str, flag: str) -> Callable[..., Any]:
    """The function at `package.module.function` or `file.py:function`; ConfigError naming `flag`."""
    return load_function(path, flag)


def hook_args(algorithm: AlgorithmConfig, *, calculate_per_token_loss: bool) -> types.SimpleNamespace:
    """The `args` a loss hook gets: the algorithm's flags by slime's names, and --custom-config-path's
    other keys."""
    fields = {name: getattr(algorithm, name) for name in algorithm.__struct_fields__}
    fields["eps_clip_high"] = algorithm.clip_high  # slime resolves the default into args
    fields["opsm_delta"] = algorithm.opsm_threshold
    fields["calculate_per_token_loss"] = calculate_per_token_loss
    fields.update(hook_extras(algorithm.custom_config_path, frozenset(fields)))
    return types.SimpleNamespace(**fields)


@functools.lru_cache(maxsize=8)
def _cached(path: str, flag: str) -> Callable[..., Any]:
    return import_hook(path, flag)


def load_loss_hooks(
    algorithm: AlgorithmConfig, *, calculate_per_token_loss: bool, step_num_samples: int
) -> LossHooks | None:
    """The hooks the algorithm names, with their `args`; None when it names neither."""
    tis_path, reducer_path = (
        algorithm.custom_tis_function_path,
        algorithm.custom_pg_loss_reducer_function_path,
    )
    if tis_path is None and reducer_path is None:
        return None
    return LossHooks(
        args=hook_args(algorithm, calculate_per_token_loss=calculate_per_token_loss),
        tis=_cached(tis_path, TIS_FLAG) if tis_path is not None else None,
        tis_path=tis_path or "",
        pg_reducer=_cached(reducer_path, REDUCER_FLAG) if reducer_path is not None else None,
        pg_reducer_path=reducer_path or "",
        calculate_per_token_loss=calculate_per_token_loss,
        step_num_samples=step_num_samples,
    )

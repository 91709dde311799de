"""slime's Megatron hooks on a trainer rank, loaded once per rank and called where slime calls them:

    --custom-megatron-init-path                    fn(args)
        once Megatron's process groups and seeds are set up, before any model is built
    --custom-megatron-before-log-prob-hook-path    fn(args, model, store_prefix)
        before every forward-only pass, the chunks in eval mode: the log-prob passes ('' the actor's,
        'ref_' the reference's, 'teacher_' the OPD teacher's) and the critic's values ('')
    --custom-megatron-before-train-step-hook-path  fn(args, rollout_id, step_id, model, optimizer,
                                                      opt_param_scheduler)
        before each optimizer step's forward/backward, after the gradients are zeroed; `step_id`
        counts the rollout's steps from 0

`model` is the list of the pass's model chunks (DDP-wrapped for the trained model), `optimizer` and
`opt_param_scheduler` Megatron's. `args` is a namespace with slime's names for the rank's flags:
the algorithm's and the Megatron slice's (the role's, with --megatron-config-path), `hf_checkpoint`,
`rank`, `world_size`, and --custom-config-path's other keys. tether runs a log-prob pass before
each optimizer step that needs one (slime runs one per rollout), so the log-prob hook may run more
often than under slime. `tether plan` checks the paths (tether.checks.megatron_hooks).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tether.rollout.hooks.loader import load_function
from tether.train.algorithms.loss_hooks import hook_args
from tether.train.config import AlgorithmConfig, MegatronConfig

INIT_FLAG = "--custom-megatron-init-path"
LOG_PROB_FLAG = "--custom-megatron-before-log-prob-hook-path"
TRAIN_STEP_FLAG = "--custom-megatron-before-train-step-hook-path"


def megatron_hook_args(
    algorithm: AlgorithmConfig, megatron: MegatronConfig, hf_checkpoint: str
) -> types.SimpleNamespace:
    """The `args` the Megatron hooks get (see the module docstring)."""
    args = hook_args(algorithm, calculate_per_token_loss=megatron.calculate_per_token_loss)
    for name in megatron.__struct_fields__:
        if not hasattr(args, name):
            setattr(args, name, getattr(megatron, name))
    args.hf_checkpoint = hf_checkpoint
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return args


@dataclass
class MegatronHooks:
    """The hooks a rank's flags name, bound to the rank's `args`."""

    args: types.SimpleNamespace
    init: Callable[..., Any] | None = None
    before_log_prob: Callable[..., Any] | None = None
    before_train_step: Callable[..., Any] | None = None

    @classmethod
    def load(
        cls, algorithm: AlgorithmConfig, megatron: MegatronConfig, hf_checkpoint: str
    ) -> MegatronHooks | None:
        """None when the flags name no Megatron hook; ConfigError naming the flag when one cannot load."""
        paths = (
            algorithm.custom_megatron_init_path,
            algorithm.custom_megatron_before_log_prob_hook_path,
            algorithm.custom_megatron_before_train_step_hook_path,
        )
        if all(path is None for path in paths):
            return None
        init, log_prob, train_step = (
            load_function(path, flag) if path is not None else None
            for path, flag in zip(paths, (INIT_FLAG, LOG_PROB_FLAG, TRAIN_STEP_FLAG), strict=True)
        )
        return cls(
            args=megatron_hook_args(algorithm, megatron, hf_checkpoint),
            init=init,
            before_log_prob=log_prob,
            before_train_step=train_step,
        )

    def after_init(self) -> None:
        if self.init is not None:
            self.init(self.args)

    def log_prob_call(self, model: Sequence[Any], store_prefix: str) -> Callable[[], None] | None:
        """What the forward-only pass calls once its chunks are in eval mode (None: no hook)."""
        hook = self.before_log_prob
        if hook is None:
            return None
        return lambda: hook(self.args, list(model), store_prefix)

    def train_step_call(
        self, rollout_id: int, step_id: int, model: Sequence[Any], optimizer: Any, scheduler: Any
    ) -> Callable[[], None] | None:
        """What the train step calls once the gradients are zeroed (None: no hook)."""
        hook = self.before_train_step
        if hook is None:
            return None
        return lambda: hook(self.args, rollout_id, step_id, list(model), optimizer, scheduler)


STORE_PREFIX = {"actor": "", "ref": "ref_", "teacher": "teacher_"}
"""slime's `store_prefix` of each log-prob pass (tether's LogProbsRequest.model)."""


__all__ = [
    "INIT_FLAG",
    "LOG_PROB_FLAG",
    "STORE_PREFIX",
    "TRAIN_STEP_FLAG",
    "MegatronHooks",
    "megatron_hook_args",
]

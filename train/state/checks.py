"""Parse-time checks of slime's trainer-state flags: --ref-update-interval, --reset-optimizer-states,
--keep-old-actor, --freeze-params-name-list, --only-train-params-name-list.

slime validates only that the two name lists are not both given; tether also refuses what would
leave a flag without effect (no reference model to update, an empty pattern list, no old
log-probs to compute) or fail later on the ranks (a pattern that is not a regular expression).
"""

from __future__ import annotations

import re
from typing import Protocol

from tether.runtime.errors import ConfigError


class TrainerStateFlags(Protocol):
    """The flags these checks read: AlgorithmConfig has them, and runs the checks as it is built."""

    @property
    def ref_update_interval(self) -> int | None: ...
    @property
    def keep_old_actor(self) -> bool: ...
    @property
    def loss_type(self) -> str: ...
    @property
    def disable_compute_advantages_and_returns(self) -> bool: ...
    @property
    def use_rollout_logprobs(self) -> bool: ...
    @property
    def get_mismatch_metrics(self) -> bool: ...
    @property
    def only_train_params_name_list(self) -> list[str] | None: ...
    @property
    def freeze_params_name_list(self) -> list[str] | None: ...

    @property
    def needs_ref_log_probs(self) -> bool: ...


def check_trainer_state_flags(cfg: TrainerStateFlags) -> None:
    if cfg.ref_update_interval is not None and not cfg.needs_ref_log_probs:
        raise ConfigError(
            "--ref-update-interval",
            cfg.ref_update_interval,
            "there is no reference model to update: it is built for --use-kl-loss or --kl-coef only",
        )
    if cfg.keep_old_actor and (cfg.loss_type == "sft_loss" or cfg.disable_compute_advantages_and_returns):
        what = (
            "--loss-type sft_loss"
            if cfg.loss_type == "sft_loss"
            else "--disable-compute-advantages-and-returns"
        )
        raise ConfigError(
            "--keep-old-actor", True, f"{what} computes no old log-probs to keep an old actor for"
        )
    if cfg.keep_old_actor and cfg.use_rollout_logprobs and not cfg.get_mismatch_metrics:
        raise ConfigError(
            "--keep-old-actor",
            True,
            "--use-rollout-logprobs takes the old log-probs from the engines instead",
        )
    only, freeze = cfg.only_train_params_name_list, cfg.freeze_params_name_list
    if only is not None and freeze is not None:
        # slime's own check (slime/utils/arguments.py)
        raise ConfigError(
            "--only-train-params-name-list",
            " ".join(only),
            "give only one of --only-train-params-name-list and --freeze-params-name-list",
        )
    for flag, patterns in (
        ("--only-train-params-name-list", only),
        ("--freeze-params-name-list", freeze),
    ):
        if patterns is None:
            continue
        if not patterns:
            raise ConfigError(flag, "", "needs at least one regex pattern of parameter names")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(flag, pattern, f"is not a regular expression: {exc}") from None

"""A hand-computable policy-loss micro-batch for the loss-hook tests (tests/unit/test_train_loss_hooks.py
and tests/integration/test_slime_mis_hook.py)."""

from __future__ import annotations

import math

import torch

from support import SUPPORT
from tether.train.algorithms import losses
from tether.train.algorithms.loss_hooks import load_loss_hooks
from tether.train.config import AlgorithmConfig

LOSS_HOOKS = SUPPORT / "slime_hooks" / "loss_hooks.py"


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def hook(name: str) -> str:
    """The path of a hook in tests/support/slime_hooks/loss_hooks.py, as a flag names it."""
    return f"{LOSS_HOOKS}:{name}"


def two_samples(cfg: AlgorithmConfig, hooks: losses.LossHooks | None, **extra: object) -> losses.LossOutput:
    """Two samples of 2 tokens each, every token weighing 1/4 of the step, on-policy (PPO's pg is
    -advantage = -1, -2, 1, -4), with train/rollout ratios 1, 3, 0.5, 1 and entropy .1, .2, .3, .4."""
    columns: dict[str, object] = {
        "log_probs": t(-1.0, -1.0, -2.0, -0.5),
        "old_log_probs": t(-1.0, -1.0, -2.0, -0.5),
        "rollout_log_probs": t(-1.0, -1.0 - math.log(3.0), -2.0 + math.log(2.0), -0.5),
        "token_weight": t(0.25, 0.25, 0.25, 0.25),
        "loss_mask": t(1, 1, 1, 1),
        "response_lengths": [2, 2],
        "advantages": t(1.0, 2.0, -1.0, 4.0),
        "entropy": t(0.1, 0.2, 0.3, 0.4),
    }
    columns.update(extra)
    return losses.policy_loss(cfg, **columns, hooks=hooks, total_lengths=[5, 6])  # type: ignore[arg-type]


def loaded_hooks(cfg: AlgorithmConfig, *, per_token: bool = False, samples: int = 2) -> losses.LossHooks:
    hooks = load_loss_hooks(cfg, calculate_per_token_loss=per_token, step_num_samples=samples)
    assert hooks is not None
    return hooks

"""--reset-optimizer-states: clear the optimizer's history before each rollout's training, as
slime does at the start of its train() (slime/backends/megatron_utils/model.py): Adam's moments
(exp_avg, exp_avg_sq) are zeroed and its step count set to 0, in each param group that counts
steps (TE's FusedAdam) and in each parameter's state (torch's Adam). The main (fp32) weights,
the learning-rate schedule and anything else in the state are kept.
"""

from __future__ import annotations

from typing import Any

import torch


def reset_optimizer_states(optimizer: Any) -> int:
    """Reset the moments and step counts of a Megatron optimizer (chained or not); returns how many
    parameter states were reset on this rank."""
    reset = 0
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_optimizer, "optimizer", None)
        if inner is None:  # a rank with no trainable parameters holds a stub
            continue
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].zero_()
            reset += 1
    return reset

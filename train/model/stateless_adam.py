"""--use-stateless-adam (slime's): Adam whose moments are zero at the start of every step.

Adam's first step from zero moments, with bias correction (which Megatron's Adam always applies),
has m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps) whatever the betas: no
exp_avg or exp_avg_sq needs to exist. The weights follow Adam with its state reset before each
step (--reset-optimizer-states at every step), and the optimizer holds no state memory.

Megatron builds its optimizer as usual (torch's Adam/AdamW on CPU, TransformerEngine's FusedAdam
on GPU); `install` then puts a `StatelessAdam` in place of each inner optimizer, over the same
param-group dicts, so Megatron's wrappers (fp32 main params, the distributed optimizer's shards)
and the LR scheduler (which writes the groups' lr and weight_decay) drive it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class StatelessAdam(torch.optim.Optimizer):
    """Adam (or AdamW, `decoupled_weight_decay`) restarted from zero moments at every step."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0: {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1): {betas}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults)

    @classmethod
    def over_groups_of(cls, inner: torch.optim.Optimizer, **defaults: Any) -> StatelessAdam:
        """A StatelessAdam stepping `inner`'s own param-group dicts. They are set as Megatron's
        distributed optimizer sets its inner optimizer's: its parameter shards are views, not
        leaves, which torch's add_param_group refuses."""
        new = cls([torch.zeros(0, requires_grad=True)], **defaults)  # torch wants one param to start
        new.param_groups = inner.param_groups
        for group in new.param_groups:
            for key, value in new.defaults.items():
                group.setdefault(key, value)
        return new

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's moments (another optimizer's) have nothing to resume here.
        super().load_state_dict({**state_dict, "state": {}})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Anything put here from outside (Megatron's placeholder state before a checkpoint load)
        # is not used, so it is not kept either.
        self.state.clear()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            # TE's FusedAdam without bias correction would scale by (1 - beta1) / sqrt(1 - beta2).
            beta1, beta2 = group["betas"]
            corrected = group.get("bias_correction", True)
            numerator = 1.0 if corrected else 1.0 - beta1
            denominator = 1.0 if corrected else (1.0 - beta2) ** 0.5
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("StatelessAdam does not take sparse gradients")
                if wd and group["decoupled_weight_decay"]:
                    param.mul_(1.0 - lr * wd)
                elif wd:
                    grad = grad.add(param, alpha=wd)  # Adam's L2 term joins the gradient
                denom = grad.abs().mul_(denominator).add_(eps)
                param.addcdiv_(grad, denom, value=-lr * numerator)
        return loss


def _no_state(*_: Any, **__: Any) -> None:
    return None


def install(optimizer: Any) -> int:
    """Swap each inner optimizer of a fresh Megatron optimizer (chained or not) for a StatelessAdam
    over the same param groups; returns how many were swapped on this rank."""
    swapped = 0
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Megatron calls it to allocate exp_avg/exp_avg_sq before a checkpoint load; there are none.
        megatron_optimizer.init_state_fn = _no_state
        inner = getattr(megatron_optimizer, "optimizer", None)
        if inner is None:  # a rank with no trainable parameters holds a stub
            continue
        if not isinstance(inner, torch.optim.Optimizer) or inner.state:
            raise TypeError(f"--use-stateless-adam replaces a fresh Adam, not {type(inner).__name__}")
        config = megatron_optimizer.config
        megatron_optimizer.optimizer = StatelessAdam.over_groups_of(
            inner,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            decoupled_weight_decay=config.decoupled_weight_decay,
        )
        swapped += 1
    return swapped

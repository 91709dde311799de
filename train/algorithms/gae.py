"""PPO with a critic, the math: token rewards, GAE, and the clipped value loss (slime's meaning).

Per sample, over its response tokens (t = 0..T-1), with the critic's values V_t:
- token rewards: r_t = -kl_coef * KL_t, plus the sample's scalar reward on the last response token;
- GAE: delta_t = r_t + gamma * V_{t+1} - V_t (V_T = 0: the response ends there),
  A_t = delta_t + gamma * lambd * A_{t+1}; returns R_t = A_t + V_t;
- value loss per token: max((V_old + clip(V - V_old, -c, c) - R)^2, (V - R)^2), c = --value-clip,
  reduced over the step like the policy loss (each token weighted by the batch's token weights).

The actor's advantages use KL-shaped rewards (its --kl-coef); the critic's returns use kl_coef 0,
as slime's critic computes them (it has no policy log-probs to shape with).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def ppo_token_rewards(
    rewards: torch.Tensor,
    response_lengths: Sequence[int],
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Flat per-response-token rewards: -kl_coef * KL on every token, each sample's reward added
    on its last response token."""
    import torch

    lengths = [int(n) for n in response_lengths]
    total = sum(lengths)
    if rewards.shape != (len(lengths),):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected ({len(lengths)},)")
    out = torch.zeros(total, dtype=torch.float32, device=rewards.device)
    if kl is not None and kl_coef != 0:
        if kl.shape != (total,):
            raise ValueError(f"kl has shape {tuple(kl.shape)}; expected ({total},)")
        out = out - kl_coef * kl.float()
    ends = torch.cumsum(torch.as_tensor(lengths, device=rewards.device), 0) - 1
    out[ends] += rewards.float()
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_lengths: Sequence[int],
    *,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), flat per response token, each sample's recursion on its own tokens."""
    import torch

    lengths = [int(n) for n in response_lengths]
    total = sum(lengths)
    for name, column in (("token_rewards", token_rewards), ("values", values)):
        if column.shape != (total,):
            raise ValueError(f"{name} has shape {tuple(column.shape)}; expected ({total},)")
    adv = torch.empty(total, dtype=torch.float32, device=values.device)
    v_all, r_all = values.float(), token_rewards.float()
    start = 0
    for n in lengths:
        v, r = v_all[start : start + n], r_all[start : start + n]
        next_v = torch.cat([v[1:], v.new_zeros(1)])
        delta = r + gamma * next_v - v
        running = v.new_zeros(())
        for t in range(n - 1, -1, -1):
            running = delta[t] + gamma * lambd * running
            adv[start + t] = running
        start += n
    return adv, adv + v_all


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    token_weight: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of a micro-batch as a weighted sum (the step's weights add to its
    mean), and its metrics: value_loss, value_clipfrac (same weighting)."""
    import torch

    diff = values - old_values
    clipped = old_values + diff.clamp(-value_clip, value_clip)
    per_token = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    w = token_weight.to(per_token.dtype)
    loss = (per_token * w).sum()
    clipfrac = ((diff.abs() > value_clip).to(w.dtype) * w).sum()
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.detach()}


__all__ = ["gae", "ppo_token_rewards", "value_loss"]

"""`tether bench e2e`'s single-process baseline (head/bench/e2e/single_process_grpo.py): GRPO's
advantages and PPO's clipped loss on hand-made numbers, and one real step on the demo's model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tether.bench.e2e.single_process_grpo import (
    Recipe,
    SingleProcessGRPO,
    clipped_pg_loss,
    group_advantages,
    read_digits,
    summary,
)
from tether.commands import demo, demo_task


def test_group_advantages_centre_and_scale_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = group_advantages(rewards, group=2, eps=0.0)
    # group 1: mean 0.5, sample std 0.7071; group 2: all equal, centred to 0 (0 / eps stays finite)
    assert torch.allclose(adv[:2], torch.tensor([0.7071068, -0.7071068]))
    assert torch.equal(group_advantages(rewards, group=2, eps=1e-6)[2:], torch.zeros(2))


def test_clipped_loss_averages_per_sample_and_clips_the_ratio() -> None:
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    # on-policy (ratio 1): -mean over samples of the advantage
    assert clipped_pg_loss(old, old, adv, mask, 0.2).item() == pytest.approx(0.5)
    # ratio e^1 > 1.2: a positive advantage is clipped (the loss stops improving), the masked token is ignored
    log_probs = torch.tensor([[1.0, 1.0, 9.0], [1.0, 0.0, 0.0]])
    loss = clipped_pg_loss(log_probs, old, adv, mask, 0.2).item()
    # sample 1: max(-e, -1.2) = -1.2 per token; sample 2 (negative advantage): max(2e, 2.4) = 2e
    assert loss == pytest.approx((-1.2 + 2.0 * math.e) / 2, rel=1e-5)


def test_one_step_on_the_demo_model_trains_it(tmp_path: Path) -> None:
    model_dir = demo.make_model(tmp_path, seed=1)
    train, _ = demo_task.split(seed=123)
    demo_task.write_jsonl(tmp_path / "train.jsonl", train[:8])
    digits = read_digits(tmp_path / "train.jsonl")
    assert digits == train[:8]
    trainer = SingleProcessGRPO(model_dir, Recipe(prompts=2, samples=4), seed=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    times = [trainer.step(digits[:2]), trainer.step(digits[2:4])]
    assert all(t.rollout_s > 0 and t.train_s > 0 and 0.0 <= t.reward_mean <= 1.0 for t in times)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert changed > 0  # weight decay moves every weight even when all rewards tie
    figures = summary(times, first_step_s=1.5)
    assert figures["steps"] == 2 and figures["first_step_s"] == 1.5
    assert figures["first_step_done_s"] == round(1.5 + times[0].step_s, 3)
    assert figures["step_time_median_s"] == round((times[0].step_s + times[1].step_s) / 2, 4)

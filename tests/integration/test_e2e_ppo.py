"""`tether run --advantage-estimator ppo` end to end on CPU: the critic's job starts beside the
actor's on the same device (no critic flag, as in slime), trains on the value loss every rollout
(the first --num-critic-only-steps rollouts alone), its values are what the actor's GAE
advantages are made of, it checkpoints beside the actor; both jobs end cleanly."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from support.e2e import Workspace, check_clean_exit, jsonl, tether

from tether.run.train_dump import load_train_data
from tether.train.algorithms.gae import gae, ppo_token_rewards

ROLLOUTS = 4


def test_ppo_critic_learns_and_its_values_make_the_actors_advantages(
    ws: Workspace, tmp_path: Path, run_dir: Path
) -> None:
    dump = tmp_path / "dump" / "{rollout_id}.bin"
    ppo = [
        "--advantage-estimator",
        "ppo",
        "--num-critic-only-steps",
        "1",
        "--gamma",
        "0.99",
        "--lambd",
        "0.95",
    ]
    one_device = ["--cpu-devices", "2", "--actor-num-gpus-per-node", "1"]
    tether(
        "run",
        *ws.flags(run_dir, "--num-rollout", str(ROLLOUTS), *one_device, *ppo, "--value-clip", "0.5"),
        "--save-debug-train-data",
        str(dump),
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "2",
    )
    events = [e["event"] for e in jsonl(run_dir / "events.jsonl")]
    assert "critic_ready" in events and "trainer_ready" in events and events[-1] == "finished"
    metrics = [m for m in jsonl(run_dir / "metrics.jsonl") if m["step"] >= 0]
    assert [m["step"] for m in metrics] == list(range(ROLLOUTS))
    for m in metrics:  # slime's names for the critic's step: train/critic-*
        assert math.isfinite(m["train/critic-value_loss"]) and m["train/critic-grad_norm"] > 0
        assert 0.0 <= m["train/critic-value_clipfrac"] <= 1.0 and m["train/critic-step_applied"] == 1.0
    # The first rollout trains the critic only; the actor trains from the second on.
    assert "train/loss" not in metrics[0] and not (tmp_path / "dump" / "0.bin").exists()
    for m in metrics[1:]:
        assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    # The critic learns: its loss on a fresh rollout (before that rollout's update) falls below
    # the loss of its freshly initialised value head (which has not met the reward scale yet).
    first = metrics[0]["train/critic-value_loss"]
    assert min(m["train/critic-value_loss"] for m in metrics[2:]) < first, [
        m["train/critic-value_loss"] for m in metrics
    ]
    # What the actor trained on: GAE advantages of the critic's values (kl_coef 0, not whitened).
    for rollout_id in range(1, ROLLOUTS):
        (step,) = load_train_data(dump.parent / f"{rollout_id}.bin").steps
        (shard,) = step  # one DP rank
        values, adv = shard["values"], shard["advantages"]
        lengths = [int(n) for n in shard["response_lengths"]]
        assert values is not None and values.shape == adv.shape == (sum(lengths),)
        rewards = torch.tensor(shard["rewards"], dtype=torch.float32)
        expect, _ = gae(
            ppo_token_rewards(rewards, lengths),
            torch.tensor(values, dtype=torch.float32),
            lengths,
            gamma=0.99,
            lambd=0.95,
        )
        assert np.allclose(adv, expect.numpy(), atol=1e-5)
        assert np.std(values) > 0  # values per position, not one constant
    # The critic's checkpoints go beside the actor's, one per saved step (resume loads the same step).
    for step in (1, 3):
        for root in (tmp_path / "ckpt", tmp_path / "ckpt" / "critic"):
            assert (root / f"iter_{step:07d}" / "metadata.json").is_file(), sorted(root.iterdir())
    check_clean_exit(run_dir)
    logs = run_dir / "logs"
    assert (logs / "critic-node0.log").is_file() and not list(logs.glob("critic-node*-error.json"))

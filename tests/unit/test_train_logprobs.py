"""Log-probs and entropy in plain torch at TP=1 (vocab-parallel at TP=2 over gloo, two processes:
tests/integration/test_train_logprobs_tp2.py)."""

from __future__ import annotations

import pytest
import torch

from tether.train.algorithms.logprobs import (
    log_probs_and_entropy,
    response_logits,
    token_entropy,
    token_log_probs,
)


def test_tp1_log_probs_and_entropy_match_full_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (6,))
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(token_log_probs(logits, targets), logp.float().gather(1, targets[:, None])[:, 0])
    ent = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(token_entropy(logits).double(), ent, atol=1e-6)


def test_response_slicing_picks_positions_that_predict_response_tokens() -> None:
    # Batch of 2 rows, seq 4; row 0 = prompt [5, 6] + response [7, 8]; row 1 = prompt [9] + response [3, 4, 2].
    from tether.rollout.sample import Sample
    from tether.train.rank.batching import build_train_batch, micro_batch_tensors

    samples = [
        Sample(index=0, rollout_id=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 1], reward=0.0),
        Sample(
            index=1, rollout_id=1, tokens=[9, 3, 4, 2], response_length=3, loss_mask=[1, 0, 1], reward=0.0
        ),
    ]
    mb = micro_batch_tensors(build_train_batch(samples, rewards=[0.0, 0.0]))
    assert mb.response_index.tolist() == [1, 2, 4, 5, 6]
    assert mb.targets.tolist() == [7, 8, 3, 4, 2]
    # One-hot "logits" that put all mass on the next token: every response log-prob is ~0.
    v = 10
    logits = torch.full((2, 4, v), -30.0)
    for row in range(2):
        for pos in range(3):
            logits[row, pos, mb.tokens[row, pos + 1]] = 30.0
    lp, ent = log_probs_and_entropy(logits, mb.response_index, mb.targets)
    assert torch.allclose(lp, torch.zeros(5), atol=1e-6)
    assert ent is not None and torch.all(ent < 1e-6)
    assert response_logits(logits, mb.response_index).shape == (5, v)


def test_temperature_divides_logits() -> None:
    logits = torch.randn(1, 3, 7)
    idx, tgt = torch.tensor([0, 1]), torch.tensor([2, 3])
    lp, _ = log_probs_and_entropy(logits, idx, tgt, temperature=0.5, with_entropy=False)
    ref = torch.log_softmax(logits[0, :2] / 0.5, -1).gather(1, tgt[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-6)


def test_entropy_gradient_matches_autograd_of_full_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    from tether.train.algorithms.logprobs import (
        _VocabParallelEntropy,  # its backward formula, without a process group
    )

    logp = torch.log_softmax(logits, -1)
    (-(logp.exp() * logp).sum(-1)).sum().backward()
    assert logits.grad is not None
    expected = logits.grad.clone()
    z = logits.detach()
    p = torch.softmax(z, -1)
    shifted = z - z.max(-1, keepdim=True).values
    mean_z = (p * shifted).sum(-1, keepdim=True)
    grad, _ = _VocabParallelEntropy.backward(
        type("Ctx", (), {"saved_tensors": (p, shifted, mean_z)})(), torch.ones(4, dtype=torch.float64)
    )
    assert torch.allclose(grad, expected, atol=1e-10)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_bad_temperature_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        log_probs_and_entropy(torch.zeros(1, 2, 3), torch.tensor([0]), torch.tensor([1]), temperature=bad)

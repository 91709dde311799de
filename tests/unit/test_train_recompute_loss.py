"""--recompute-loss-function: the train step's loss (tether.train.rank.step.rl_loss_fn) runs under
torch.utils.checkpoint (non-reentrant, as slime wraps it), so its vocabulary-wide intermediates are
not kept from forward to backward but recomputed there. The same loss, metrics and gradients; far
fewer tensors saved for backward; the loss runs again in the backward pass. In this process on a
one-rank gloo group (Megatron's parallel state is what the loss asks for its TP group). The critic's
value loss (tether.train.algorithms.critic) is wrapped the same way, as slime's is."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from support.train_checks.launcher import make_batch
from test_train_mtp import one_rank  # noqa: F401  (the one-rank Megatron fixture)

from tether.config import resolve
from tether.train.algorithms import losses
from tether.train.config import AlgorithmConfig
from tether.train.rank.batching import MicroBatchTensors, micro_batch_tensors
from tether.train.rank.step import StepOptions, rl_loss_fn

VOCAB = 320
# PPO clipping, a KL term against the reference and an entropy bonus: the loss's full set of terms.
ALGO = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Megatron's imports, as test_train_mtp.py
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _micro_batch() -> MicroBatchTensors:
    batch = make_batch(4, seed=1, vocab=VOCAB)
    n = int(batch.response_lengths.sum())
    rng = np.random.default_rng(0)
    batch.advantages = rng.standard_normal(n).astype(np.float32)
    batch.old_log_probs = (-6.0 * rng.random(n)).astype(np.float32)
    batch.ref_log_probs = (-6.0 * rng.random(n)).astype(np.float32)
    return micro_batch_tensors(batch)


def _run(mb: MicroBatchTensors, logits: torch.Tensor, *, recompute: bool) -> dict[str, Any]:
    algo = msgspec.structs.replace(ALGO, recompute_loss_function=recompute)
    loss_fn = rl_loss_fn(algo, VOCAB, StepOptions())
    x = logits.clone().requires_grad_(True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, metrics = loss_fn(x, mb)
    loss.backward()
    assert x.grad is not None
    return {
        "loss": loss.detach(),
        "metrics": {k: v.detach() for k, v in metrics.items()},
        "grad": x.grad,
        "saved_elements": sum(saved),
    }


def test_recomputed_loss_gives_the_same_loss_and_gradients_saving_less(
    one_rank: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mb = _micro_batch()
    b, s = mb.tokens.shape
    logits = torch.randn(b, s, VOCAB, generator=torch.Generator().manual_seed(3))
    calls = 0
    policy_loss = losses.policy_loss

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return policy_loss(*args, **kwargs)

    monkeypatch.setattr(losses, "policy_loss", counted)
    kept = _run(mb, logits, recompute=False)
    assert calls == 1
    redone = _run(mb, logits, recompute=True)
    assert calls == 3  # once forward, once again in the backward pass
    torch.testing.assert_close(redone["loss"], kept["loss"], rtol=0, atol=0)
    torch.testing.assert_close(redone["grad"], kept["grad"], rtol=0, atol=0)
    assert redone["metrics"].keys() == kept["metrics"].keys()
    for key, value in kept["metrics"].items():
        torch.testing.assert_close(redone["metrics"][key], value, rtol=0, atol=0, msg=key)
    assert float(kept["grad"].abs().sum()) > 0
    # Both keep the loss's input, the logits, for backward. Without recomputation the loss's own
    # vocabulary-wide intermediates (log-softmax and entropy over every response token) come on top.
    n_tokens = int(mb.response_index.numel())
    assert kept["saved_elements"] - logits.numel() >= 2 * n_tokens * VOCAB
    assert redone["saved_elements"] <= logits.numel()


def test_the_flag_is_off_by_default_and_reaches_the_algorithm_slice() -> None:
    run = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
    assert not resolve(run).algorithm.recompute_loss_function
    assert resolve([*run, "--recompute-loss-function"]).algorithm.recompute_loss_function


class _Stop(Exception):
    pass


@pytest.mark.parametrize("recompute", [False, True])
def test_the_critics_value_loss_is_recomputed_too(monkeypatch: pytest.MonkeyPatch, recompute: bool) -> None:
    # slime recomputes whichever loss its loss_function dispatches to, the value loss included.
    from tether.train.algorithms import critic
    from tether.train.rank import step

    def recomputed(loss_fn: Any) -> Any:
        return ("recomputed", loss_fn)

    def run_schedule(chunks: Any, config: Any, mbs: Any, loss_fn: Any, **_: Any) -> Any:
        given.append(loss_fn)
        raise _Stop

    given: list[Any] = []
    monkeypatch.setattr(step, "build_micro_batches", lambda *a, **k: [])
    monkeypatch.setattr(step, "recomputed", recomputed)
    monkeypatch.setattr(step, "run_schedule", run_schedule)
    chunk = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None)
    model = SimpleNamespace(
        chunks=[chunk],
        optimizer=SimpleNamespace(zero_grad=lambda: None),
        config=SimpleNamespace(calculate_per_token_loss=False),
    )
    shard = SimpleNamespace(values=1, returns=1)
    with pytest.raises(_Stop):
        critic.value_train_step(model, shard, [], AlgorithmConfig(recompute_loss_function=recompute))  # type: ignore[arg-type]
    (loss_fn,) = given
    assert (isinstance(loss_fn, tuple) and loss_fn[0] == "recomputed") == recompute

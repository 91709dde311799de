"""Log-probs and entropy: plain torch at TP=1, and vocab-parallel at TP=2 over gloo (two processes)."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tether.train.logprobs import log_probs_and_entropy, response_logits, token_entropy, token_log_probs


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
    from tether.train.batching import build_train_batch, micro_batch_tensors

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
    from tether.train.logprobs import _VocabParallelEntropy  # its backward formula, without a process group

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        from tether.train import megatron_cpu

        megatron_cpu.apply()
        with megatron_cpu.quiet_megatron_imports():
            from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        group = parallel_state.get_tensor_model_parallel_group()
        torch.manual_seed(0)  # same full logits on both ranks; each keeps its vocab half
        full = torch.randn(2, 5, 16, dtype=torch.float32) * 3
        index = torch.tensor([0, 1, 3, 5, 6, 8])
        targets = torch.tensor([0, 7, 8, 15, 3, 12])  # both halves of the vocabulary
        shard = full[..., rank * 8 : (rank + 1) * 8].clone().requires_grad_()
        kept = shard.detach().clone()
        lp, ent = log_probs_and_entropy(shard, index, targets, tp_group=group)
        assert ent is not None
        assert torch.equal(shard.detach(), kept), "the caller's logits were modified in place"
        full_rows = full.reshape(-1, 16)[index].clone().requires_grad_()
        logp = torch.log_softmax(full_rows, -1)
        ref_lp = logp.gather(1, targets[:, None])[:, 0]
        ref_ent = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(lp, ref_lp, atol=5e-6), (lp, ref_lp)
        assert torch.allclose(ent, ref_ent, atol=5e-6), (ent, ref_ent)
        # Gradients: each rank's logits gradient equals its vocab slice of the full-vocab gradient.
        weights = torch.linspace(0.5, 1.5, 6)
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        ((ref_lp * weights).sum() + (ref_ent * weights).sum()).backward()
        assert shard.grad is not None and full_rows.grad is not None
        mine = shard.grad.reshape(-1, 8)[index]
        assert torch.allclose(mine, full_rows.grad[:, rank * 8 : (rank + 1) * 8], atol=5e-6)
        # Without Megatron's TP group (a different group object), the function refuses clearly.
        other = torch.distributed.new_group([0, 1])
        try:
            token_log_probs(response_logits(shard.detach(), index), targets, tp_group=other)
        except RuntimeError as e:
            assert "parallel state" in str(e)
        else:
            raise AssertionError("a foreign TP group was accepted")
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        Path(out_dir, f"ok{rank}").write_text("ok")
    except BaseException:
        Path(out_dir, f"err{rank}").write_text(traceback.format_exc())
        raise


def test_tp2_vocab_parallel_matches_full_vocab(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f.read_text() for f in sorted(tmp_path.glob("err*"))]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(f.name for f in tmp_path.glob("ok*")) == ["ok0", "ok1"]


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_bad_temperature_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        log_probs_and_entropy(torch.zeros(1, 2, 3), torch.tensor([0]), torch.tensor([1]), temperature=bad)

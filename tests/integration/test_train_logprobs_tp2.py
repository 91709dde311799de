"""Vocab-parallel log-probs and entropy at TP=2: two processes over gloo with Megatron's TP group
match the full-vocabulary softmax, gradients included."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
from support.ranks import run_ranks

from tether.train.algorithms.logprobs import log_probs_and_entropy, response_logits, token_log_probs


def _tp_worker(rank: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        from tether.train.model import megatron_cpu

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


def test_tp2_vocab_parallel_matches_full_vocab(tmp_path: Path, free_port: int) -> None:
    exits = run_ranks(_tp_worker, lambda r: (r, free_port, str(tmp_path)), tmp_path, timeout=180)
    assert exits == [0, 0]
    assert sorted(f.name for f in tmp_path.glob("ok*")) == ["ok0", "ok1"]

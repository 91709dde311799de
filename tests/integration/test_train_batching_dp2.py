"""The per-rollout loss denominator at DP=2: a rollout's segments split over micro-batches and two
data-parallel ranks (two processes over gloo) still give the step mean of its tokens."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from support.ranks import run_ranks

from tether.rollout.sample import Sample
from tether.train.rank.batching import build_train_batch, plan_micro_batches, shard_for_data_parallel


def _dp_worker(rank: int, port: int, out_dir: str, shard_bytes: list[bytes]) -> None:
    """One DP rank: its shard's micro-batch losses summed, then all-reduced; so are gradients."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        shard = msgspec.msgpack.decode(shard_bytes[rank])
        lengths = shard["lengths"]
        token_losses = torch.tensor(shard["losses"], dtype=torch.float64)
        weights = torch.tensor(shard["weights"], dtype=torch.float64)
        scale = torch.ones((), dtype=torch.float64, requires_grad=True)  # d(step loss)/d(scale) = step loss
        total = torch.zeros((), dtype=torch.float64)
        start = 0
        for n in shard["micro_batches"]:
            sl = slice(start, start + n)
            total = total + (scale * token_losses[sl] * weights[sl]).sum()
            start += n
        assert start == sum(lengths)
        total.backward()
        loss = total.detach().clone()
        torch.distributed.all_reduce(loss)
        grad = scale.grad.detach().clone()  # type: ignore[union-attr]
        torch.distributed.all_reduce(grad)  # DDP sums gradients (then Megatron rescales; see losses)
        Path(out_dir, f"rank{rank}").write_text(f"{loss.item():.12f} {grad.item():.12f}")
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(out_dir, f"err{rank}").write_text(traceback.format_exc())
        raise


def test_per_rollout_denominator_across_segments_micro_batches_and_dp2(
    tmp_path: Path, free_port: int
) -> None:
    """Rollout 7 is four segments with token losses [1], [3], [5, 7] and a masked-out segment; they
    land on different micro-batches and DP ranks. Rollout 9 has token losses [10, 20]. Per-rollout
    mean: (4 + 15) / 2 = 9.5 on the all-reduced sum of both ranks' micro-batch losses."""
    segs = [(7, [1.0]), (7, [3.0]), (7, [5.0, 7.0]), (9, [10.0, 20.0]), (7, [100.0])]
    samples = []
    for i, (rid, ls) in enumerate(segs):
        samples.append(
            Sample(
                index=i,
                rollout_id=rid,
                tokens=[1, 2] + [3] * len(ls),
                response_length=len(ls),
                loss_mask=[0] * len(ls) if ls == [100.0] else [1] * len(ls),
                reward=0.0,
            )
        )
    b = build_train_batch(samples, rewards=[0.0] * len(samples), per_rollout_loss_mean=True)
    b.advantages = np.concatenate([np.asarray(ls, dtype=np.float32) for _, ls in segs])  # rides along
    shards = shard_for_data_parallel(b, 2)
    plan = plan_micro_batches(shards, micro_batch_size=1)
    # The test means something only if rollout 7's trainable segments sit on both ranks.
    assert all(7 in s.rollout_ids[s.loss_weights > 0].tolist() for s in shards)
    payloads = []
    for shard, mbs in zip(shards, plan, strict=True):
        order = [i for mb in mbs for i in mb]
        ordered = shard.select(order)
        ro = ordered.response_offsets
        assert ordered.advantages is not None
        token_weights = np.repeat(ordered.loss_weights, ordered.response_lengths) * ordered.loss_masks
        payloads.append(
            msgspec.msgpack.encode(
                {
                    "lengths": ordered.response_lengths.tolist(),
                    "losses": ordered.advantages.tolist(),
                    "weights": token_weights.tolist(),
                    "micro_batches": [int(ro[k + 1] - ro[k]) for k in range(ordered.num_samples)],
                }
            )
        )
    assert {len(p) for p in plan} == {len(plan[0])}
    run_ranks(_dp_worker, lambda r: (r, free_port, str(tmp_path), payloads), tmp_path, timeout=120)
    results = [tuple(map(float, Path(tmp_path, f"rank{r}").read_text().split())) for r in range(2)]
    for loss, grad in results:
        assert loss == pytest.approx(9.5)
        assert grad == pytest.approx(9.5)

"""The columnar train batch: building, shard balance, micro-batches, tensors (the per-rollout
denominator over two DP ranks: tests/integration/test_train_batching_dp2.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.rollout.sample import Sample, SampleContractError
from tether.train.rank.batching import (
    TrainBatch,
    balanced_partition,
    build_train_batch,
    micro_batch_tensors,
    packed_sequence_layout,
    plan_micro_batches,
    shard_for_data_parallel,
    split_steps,
    step_loss_weights,
)


def make_samples(lengths: list[tuple[int, int]], rollout_ids: list[int | None] | None = None) -> list[Sample]:
    out = []
    for i, (prompt, resp) in enumerate(lengths):
        rid = i if rollout_ids is None else rollout_ids[i]
        out.append(
            Sample(
                index=i,
                group_index=i // 2,
                rollout_id=rid,
                tokens=[(i * 7 + k) % 50 + 1 for k in range(prompt + resp)],
                response_length=resp,
                loss_mask=[1] * resp,
                rollout_log_probs=[-0.5] * resp,
                reward=float(i),
            )
        )
    return out


def test_build_batch_columns() -> None:
    samples = make_samples([(2, 3), (1, 1)], rollout_ids=[4, None])
    samples[0].loss_mask = [1, 0, 1]
    samples[0].rollout_log_probs = [-0.1, 0.0, -0.3]
    b = build_train_batch(samples, rewards=[0.5, -0.5], raw_rewards=[1.0, 0.0])
    assert b.tokens.dtype == np.int32 and b.tokens.tolist() == samples[0].tokens + samples[1].tokens
    assert b.offsets.tolist() == [0, 5, 7]
    assert b.response_lengths.tolist() == [3, 1]
    assert b.loss_masks.dtype == np.uint8 and b.loss_masks.tolist() == [1, 0, 1, 1]
    assert b.rollout_log_probs is not None and b.rollout_log_probs.dtype == np.float32
    assert b.rollout_log_probs.tolist() == pytest.approx([-0.1, 0.0, -0.3, -0.5])
    assert b.rollout_ids.tolist() == [4, 0]  # an unset rollout_id gets a fresh id (0 is free)
    assert b.rewards.tolist() == [0.5, -0.5] and b.raw_rewards.tolist() == [1.0, 0.0]
    assert b.loss_weights.tolist() == pytest.approx([1 / 3, 1 / 3])  # per-token mean over 3 trainable tokens
    assert b.trainable_per_sample().tolist() == [2, 1]


def test_bad_samples_are_named() -> None:
    s = make_samples([(2, 3)])
    s[0].loss_mask = [1, 1]
    with pytest.raises(SampleContractError, match="loss_mask"):
        build_train_batch(s, rewards=[0.0])
    s = make_samples([(2, 3), (2, 2)])
    s[1].rollout_log_probs = None
    with pytest.raises(SampleContractError, match="rollout_log_probs"):
        build_train_batch(s, rewards=[0.0, 0.0])
    with pytest.raises(ValueError, match="rewards"):
        build_train_batch(make_samples([(2, 3)]), rewards=[0.0, 1.0])


def test_per_rollout_weights_sum_segments_of_one_rollout() -> None:
    # Rollout 7: segments with 2 and 2 trainable tokens; rollout 8: one segment of 1 token.
    samples = make_samples([(1, 2), (1, 2), (1, 1)], rollout_ids=[7, 7, 8])
    b = build_train_batch(samples, rewards=[0.0] * 3, per_rollout_loss_mean=True)
    assert b.loss_weights.tolist() == pytest.approx([1 / 8, 1 / 8, 1 / 2])
    assert step_loss_weights(b, per_rollout_loss_mean=False).tolist() == pytest.approx([0.2] * 3)


def test_select_and_filler() -> None:
    b = build_train_batch(make_samples([(2, 3), (1, 1), (3, 2)]), rewards=[0.0, 1.0, 2.0])
    s = b.select([2, 0, 2], filler=[False, False, True])
    s.validate()
    assert (
        s.tokens.tolist()
        == b.sample_tokens(2).tolist() + b.sample_tokens(0).tolist() + b.sample_tokens(2).tolist()
    )
    assert s.loss_masks.tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert s.loss_weights[2] == 0.0 and s.loss_weights[0] == b.loss_weights[2]
    with pytest.raises(IndexError):
        b.select([3])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(1, 5))
def test_balanced_partition_properties(weights: list[int], parts: int) -> None:
    groups = balanced_partition(weights, parts, equal_size=True)
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    assert groups == balanced_partition(weights, parts, equal_size=True)  # deterministic
    free = balanced_partition(weights, parts, equal_size=False)
    sums = [sum(weights[i] for i in g) for g in free]
    # Greedy LPT: the spread between the heaviest and lightest group is at most the largest item.
    assert max(sums) - min(sums) <= max(weights)


def test_shards_balance_tokens_and_keep_the_step_mean() -> None:
    lengths = [(10, 90), (10, 10), (10, 40), (5, 5), (10, 50), (20, 30), (1, 1)]
    b = build_train_batch(make_samples(lengths), rewards=[0.0] * 7)
    shards = shard_for_data_parallel(b, 2)
    assert [s.num_samples for s in shards] == [4, 4]  # 7 samples: one shard gets a filler copy
    real = [s.loss_weights > 0 for s in shards]
    token_sums = [int(s.total_lengths[m].sum()) for s, m in zip(shards, real, strict=True)]
    assert abs(token_sums[0] - token_sums[1]) <= max(p + r for p, r in lengths)
    assert sum(int(s.num_trainable_tokens) for s in shards) == b.num_trainable_tokens
    total_weight = sum(float((s.loss_weights * s.trainable_per_sample()).sum()) for s in shards)
    assert total_weight == pytest.approx(1.0)
    with pytest.raises(ValueError, match="data-parallel"):
        shard_for_data_parallel(b.select([0]), 2)


def test_static_and_dynamic_micro_batches_have_equal_counts_per_rank() -> None:
    lengths = [(5, 5), (5, 15), (2, 2), (10, 30), (3, 3), (4, 4), (5, 10), (6, 6)]
    b = build_train_batch(make_samples(lengths), rewards=[0.0] * 8)
    shards = shard_for_data_parallel(b, 2)
    static = plan_micro_batches(shards, micro_batch_size=3)
    assert [len(p) for p in static] == [2, 2]
    assert [[len(mb) for mb in p] for p in static] == [[3, 1], [3, 1]]
    dyn = plan_micro_batches(shards, max_tokens_per_gpu=40)
    assert len(dyn[0]) == len(dyn[1])
    for shard, plan in zip(shards, dyn, strict=True):
        assert sorted(i for mb in plan for i in mb) == list(range(shard.num_samples))
        assert all(int(shard.total_lengths[mb].sum()) <= 40 for mb in plan)
    with pytest.raises(ValueError, match="max-tokens-per-gpu"):
        plan_micro_batches(shards, max_tokens_per_gpu=30)


def test_micro_batch_tensors_align_next_token_positions() -> None:
    samples = make_samples([(2, 3), (1, 2)])
    samples[0].loss_mask = [1, 0, 1]
    b = build_train_batch(samples, rewards=[0.0, 0.0])
    b.advantages = np.arange(5, dtype=np.float32)
    mb = micro_batch_tensors(b)
    assert mb.tokens.shape == (2, 5)
    assert mb.tokens[1, 3:].tolist() == [0, 0]  # right padding
    assert mb.response_index.tolist() == [1, 2, 3, 5, 6]
    assert mb.targets.tolist() == samples[0].tokens[2:] + samples[1].tokens[1:]
    flat = mb.tokens.reshape(-1)
    assert flat[mb.response_index + 1].tolist() == mb.targets.tolist()
    assert mb.loss_mask.tolist() == [1, 0, 1, 1, 1]
    assert mb.token_weight.tolist() == pytest.approx([0.25, 0.0, 0.25, 0.25, 0.25])
    assert mb.advantages is not None and mb.advantages.tolist() == [0, 1, 2, 3, 4]
    # Attention: causal, and no query attends to a padded key.
    assert mb.attention_mask.shape == (2, 1, 5, 5)
    assert not mb.attention_mask[0, 0, 4, :].any()
    assert mb.attention_mask[1, 0, 2, 3:].all() and not mb.attention_mask[1, 0, 2, :3].any()
    packed = packed_sequence_layout(b)
    assert packed["cu_seqlens"].tolist() == [0, 5, 8]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert packed["response_index"].tolist() == [1, 2, 3, 5, 6]
    assert packed["tokens"][0, packed["response_index"] + 1].tolist() == mb.targets.tolist()


def test_micro_batch_padded_to_another_ranks_shape_adds_only_padding() -> None:
    # Megatron's allgather token dispatcher at EP > 1 needs every rank's micro-batch to hold the same
    # number of tokens: a rank pads to the largest (rows, positions) of the group.
    samples = make_samples([(2, 3), (1, 2)])
    b = build_train_batch(samples, rewards=[0.0, 0.0])
    plain = micro_batch_tensors(b)
    padded = micro_batch_tensors(b, min_shape=(3, 7), pad_to_multiple_of=2)
    assert padded.tokens.shape == (3, 8)  # 7 positions, to a multiple of 2
    assert padded.tokens[:2, :5].tolist() == plain.tokens.tolist() and not padded.tokens[2].any()
    # The same response tokens, at their rows in the wider layout; nothing of the filler row.
    assert padded.targets.tolist() == plain.targets.tolist()
    flat = padded.tokens.reshape(-1)
    assert flat[padded.response_index + 1].tolist() == padded.targets.tolist()
    assert padded.total_lengths == [5, 3] and padded.response_lengths == [3, 2]
    assert padded.num_tokens == plain.num_tokens == 8
    # No real query attends to a padding key; the filler row attends to nothing.
    assert padded.attention_mask[2, 0].all()
    assert padded.attention_mask[0, 0, 4, 5:].all() and not padded.attention_mask[0, 0, 4, :5].any()
    # A larger own shape wins.
    assert micro_batch_tensors(b, min_shape=(1, 2)).tokens.shape == (2, 5)


def test_split_steps_keeps_rollouts_together() -> None:
    samples = make_samples([(1, 1)] * 6, rollout_ids=[0, 0, 1, 2, 2, 3])
    b = build_train_batch(samples, rewards=[0.0] * 6, per_rollout_loss_mean=True)
    steps = split_steps(b, 2, per_rollout_loss_mean=True)
    assert [s.rollout_ids.tolist() for s in steps] == [[0, 0, 1], [2, 2, 3]]
    assert steps[0].loss_weights.tolist() == pytest.approx([0.25, 0.25, 0.5])  # per-rollout kept per step
    with pytest.raises(ValueError, match="rollouts cannot fill"):
        split_steps(b, 5, per_rollout_loss_mean=True)


def test_batch_travels_as_msgpack_with_array_frames() -> None:
    """The struct encodes with an ndarray hook (the runtime RPC's way) and decodes typed."""
    b = build_train_batch(make_samples([(2, 3), (1, 2)]), rewards=[1.0, 2.0])
    frames: list[np.ndarray] = []

    def enc(obj: object) -> object:
        if isinstance(obj, np.ndarray):
            frames.append(obj)
            return msgspec.msgpack.Ext(1, msgspec.msgpack.encode([len(frames) - 1, obj.dtype.str, obj.shape]))
        raise NotImplementedError(type(obj))

    def ext(code: int, data: memoryview) -> object:
        i, dtype, shape = msgspec.msgpack.decode(data)
        return np.frombuffer(frames[i].tobytes(), dtype=dtype).reshape(shape)

    wire = msgspec.msgpack.encode(b, enc_hook=enc)
    back = msgspec.msgpack.decode(wire, type=TrainBatch, ext_hook=ext, dec_hook=lambda t, o: o)
    back.validate()
    assert back.tokens.tolist() == b.tokens.tolist() and back.advantages is None

"""--context-parallel-size: the flag reaches Megatron's config, the parallel state and the layer spec;
each CP rank's share of a micro-batch (tether.train.parallel.context.localize) lines up with the
logits it computes. Numerical agreement of CP=2 with the other layouts (log-probs, losses, grad
norms over five steps) is tests/integration/test_train_steps.py's `cp2` layout."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from support.train_checks.launcher import make_batch
from test_train_megatron_args import RUN, transformer

from tether.config import resolve
from tether.runtime.errors import ConfigError
from tether.train.model import megatron_args
from tether.train.parallel import context as context_parallel
from tether.train.parallel.context import CPLayout
from tether.train.rank.batching import micro_batch_tensors

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron's spec module imports a deprecated TE shim
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401


def test_each_rank_holds_two_chunks_and_the_ranks_cover_the_sequence_once() -> None:
    got = [context_parallel.positions(16, 2, r).tolist() for r in (0, 1)]
    # Megatron's load-balanced order: rank r holds chunks r and 2*CP-1-r (get_pos_emb_on_this_cp_rank).
    assert got == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    four = torch.cat([context_parallel.positions(24, 4, r) for r in range(4)])
    assert sorted(four.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2 x 4"):
        context_parallel.positions(12, 4, 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_share_predicts_exactly_its_response_tokens(rank: int) -> None:
    batch = make_batch(4, seed=3)
    mb = micro_batch_tensors(batch, pad_to_multiple_of=4)
    b, s = mb.tokens.shape
    layout = CPLayout(2, rank, None)
    local = context_parallel.localize(mb, layout)
    pos = layout.positions(s)
    assert local.tokens.shape == (b, s // 2) and torch.equal(local.tokens, mb.tokens[:, pos])
    assert torch.equal(local.position_ids, mb.position_ids[:, pos])
    # The rows of the local attention mask are the full mask's rows at this rank's positions.
    assert torch.equal(local.attention_mask, mb.attention_mask[:, :, pos, :])
    # Each local response row sits at the global position the full layout's response_index names.
    which = local.cp_which
    assert which is not None
    full_rows = mb.response_index[which]
    rows, cols = local.response_index // (s // 2), local.response_index % (s // 2)
    assert torch.equal(rows * s + pos[cols], full_rows)
    assert torch.equal(local.targets, mb.targets[which])
    # Per-response-token columns stay whole; the lengths stay the samples' own.
    assert local.loss_mask.shape == mb.loss_mask.shape
    assert local.total_lengths == [int(n) for n in batch.total_lengths]


def test_the_two_ranks_split_the_response_tokens_between_them() -> None:
    mb = micro_batch_tensors(make_batch(6, seed=4), pad_to_multiple_of=4)
    parts = [context_parallel.localize(mb, CPLayout(2, r, None)).cp_which for r in (0, 1)]
    joined = torch.cat([p for p in parts if p is not None])
    assert sorted(joined.tolist()) == list(range(mb.targets.numel()))


def test_bare_forward_input_gets_the_causal_mask_of_its_positions() -> None:
    from tether.train.rank.step import MicroBatch

    tokens = torch.arange(8).reshape(1, 8)
    mb = context_parallel.localize(MicroBatch(tokens, tokens.clone()), CPLayout(2, 1, None))
    pos = torch.tensor([2, 3, 4, 5])
    want = torch.arange(8)[None, :] > pos[:, None]
    assert torch.equal(mb.attention_mask[0, 0], want)


def test_the_flag_reaches_megatron_and_pads_micro_batches_to_its_chunks() -> None:
    cfg = resolve([*RUN, "--cpu-devices", "2", "--context-parallel-size", "2"])
    assert megatron_args.init_distributed_kwargs(cfg.megatron, cfg.algorithm)["context_parallel"] == 2
    tc = transformer(cfg)
    assert tc.context_parallel_size == 2
    assert megatron_args.sequence_multiple(tc) == 4  # 2 chunks per CP rank
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    sp = resolve([*RUN, "--cpu-devices", "4", "--context-parallel-size", "2", *tp_sp])
    assert megatron_args.sequence_multiple(transformer(sp)) == 8  # and each chunk pair split over TP
    assert cfg.megatron.data_parallel_size(4) == 2


def test_the_local_spec_gathers_keys_and_values_under_context_parallelism() -> None:
    from tether.train.model import bridge

    cfg = resolve([*RUN, "--cpu-devices", "2", "--context-parallel-size", "2"])
    spec = bridge.layer_spec(transformer(cfg), False, 0)
    names = {layer.submodules.self_attention.submodules.core_attention.__name__ for layer in spec.layer_specs}
    assert names == {"ContextParallelDotProductAttention"}
    plain = bridge.layer_spec(transformer(resolve(RUN)), False, 0)
    assert {
        layer.submodules.self_attention.submodules.core_attention.__name__ for layer in plain.layer_specs
    } == {"DotProductAttention"}


def test_labels_of_multi_token_prediction_are_sliced_like_the_tokens() -> None:
    t = torch.arange(16).reshape(2, 8)
    got = context_parallel.slice_sequence(t, CPLayout(2, 0, None))
    assert got.tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert context_parallel.slice_sequence(t, CPLayout(1, 0, None)) is t


def test_world_must_divide_by_tp_pp_cp() -> None:
    cfg = resolve([*RUN, "--cpu-devices", "2", "--context-parallel-size", "2"])
    assert cfg.megatron.model_parallel_size == 2
    with pytest.raises(ConfigError):
        cfg.megatron.data_parallel_size(3)
    assert np.all(context_parallel.positions(8, 1, 0).numpy() == np.arange(8))


def test_the_gathered_shares_go_back_to_position_order() -> None:
    # What each rank holds, laid end to end in rank order (an all-gather), then reordered.
    for size in (2, 3):
        shares = torch.cat([context_parallel.positions(12 * size, size, r) for r in range(size)])
        inverse = context_parallel._global_order(12, size)
        assert shares.index_select(0, inverse).tolist() == list(range(12 * size))

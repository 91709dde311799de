"""--balance-by-flops (tether.train.rank.flops_balance): slime's FLOPs estimate, Karmarkar–Karp, and the
micro-batches and DP shards a step gets with the flag, against the token-based plan without it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from tether.config import resolve
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.model.hf_config import ModelArch
from tether.train.rank.batching import TrainBatch, build_train_batch, plan_micro_batches
from tether.train.rank.flops_balance import (
    FlopsModel,
    flops_balanced_schedule,
    flops_model,
    karmarkar_karp,
)
from tether.train.rank.work import WorkOptions, rollout_steps, shard_and_plan

# h=8, 2 heads of 4, 1 KV group, SwiGLU 16, 3 layers, vocab 10
DENSE = ModelArch(
    model_type="llama",
    vocab_size=10,
    hidden_size=8,
    ffn_hidden_size=16,
    num_layers=3,
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=4,
    norm_epsilon=1e-6,
    rope_theta=1e4,
    rope_scaling_factor=None,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    qkv_bias=False,
    qk_layernorm=False,
)
MODEL = flops_model(DENSE)


def test_flops_estimate_on_known_shapes() -> None:
    # Per layer and token: Q 2*8*2*4 = 128, K/V 4*8*1*4 = 128, output 2*8*8 = 128, SwiGLU 6*8*16 = 768;
    # the output layer 2*8*10 = 160; per token²: Q K^T (causal) 2*4 + A V 2*4 = 16 per layer.
    assert MODEL == FlopsModel(linear=3 * (128 + 128 + 128 + 768) + 160, quadratic=3 * 16)
    # slime's calculate_fwd_flops([L], args) for these args gives 3664, 19280, 563024 (checked against
    # slime/utils/flops_utils.py at the commit head/docs_tables.py names).
    assert [MODEL.of(n) for n in (1, 5, 77)] == [3664, 19280, 563024]
    # MoE: layer 0 dense, layers 1-2 with top-2 experts of 5 plus a shared expert of 3 (F = 13).
    moe = dataclasses.replace(
        DENSE,
        model_type="qwen3_moe",
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=5,
        moe_shared_expert_intermediate_size=3,
        moe_layer_freq=(0, 1, 1),
    )
    assert flops_model(moe) == FlopsModel(linear=(384 + 768) + 2 * (384 + 6 * 8 * 13) + 160, quadratic=48)
    assert flops_model(moe).of(77) == 540848  # slime's
    # Multi-latent attention (q_lora 4, kv_lora 3, qk 2 + rope 1, v 2): Q 2*4*(8+2*3) = 112,
    # KV 2*3*(8+2*(2+2)) + 2*8*1 = 112; per token² 2*(2+1) + 2*2 = 10 per layer.
    mla = dataclasses.replace(
        DENSE,
        model_type="deepseek_v3",
        multi_latent_attention=True,
        q_lora_rank=4,
        kv_lora_rank=3,
        qk_head_dim=2,
        qk_pos_emb_head_dim=1,
        v_head_dim=2,
    )
    assert flops_model(mla) == FlopsModel(linear=3 * (112 + 112 + 128 + 768) + 160, quadratic=30)
    assert flops_model(mla).of(77) == 448910  # slime's


def test_karmarkar_karp_balances_and_keeps_equal_sizes() -> None:
    groups = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in g) for g in groups) == [14, 16]  # largest differencing
    for parts in (2, 3):
        groups = karmarkar_karp([8, 7, 6, 5, 4, 4], parts, equal_size=True)
        assert {len(g) for g in groups} == {6 // parts}
        assert sorted(i for g in groups for i in g) == list(range(6))
    with pytest.raises(ValueError, match="equal size"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="cannot fill"):
        karmarkar_karp([1], 2, equal_size=False)


def spread(values: list[int]) -> int:
    return max(values) - min(values)


def test_flops_partition_balances_flops_where_tokens_balance_tokens() -> None:
    # One long sample: its attention costs more than its share of the tokens says.
    lengths = [900, 500, 400, 300, 300, 200, 100, 100]
    flops = [MODEL.of(n) for n in lengths]
    by_flops = karmarkar_karp(flops, 2, equal_size=False)
    by_tokens = karmarkar_karp(lengths, 2, equal_size=False)
    assert by_flops != by_tokens
    assert by_flops == [[0], [1, 2, 3, 4, 5, 6, 7]]  # the long one alone
    assert by_tokens == [[0, 4, 6, 7], [1, 2, 3, 5]]  # 1400 tokens each
    flops_of = lambda gs: [sum(flops[i] for i in g) for g in gs]  # noqa: E731
    tokens_of = lambda gs: [sum(lengths[i] for i in g) for g in gs]  # noqa: E731
    assert spread(flops_of(by_flops)) < spread(flops_of(by_tokens)) / 2
    assert spread(tokens_of(by_tokens)) < spread(tokens_of(by_flops))


def batch_of(lengths: list[int]) -> TrainBatch:
    samples = [Sample(index=i, tokens=[1] * n, response_length=n // 2) for i, n in enumerate(lengths)]
    return build_train_batch(samples, rewards=[0.0] * len(lengths))


def test_the_flag_plans_a_skewed_step_by_flops_and_the_default_by_tokens() -> None:
    batch = batch_of([1000, 400, 400, 400, 400, 400])
    tokens = WorkOptions(global_batch_size=6, max_tokens_per_gpu=1000, balance_data=True)
    by_flops = msgspec.structs.replace(tokens, flops=MODEL)
    _, token_shards, token_plans = shard_and_plan(batch, 2, tokens)
    groups, flops_shards, flops_plans = shard_and_plan(batch, 2, by_flops)
    # Tokens: equal sample counts, token-balanced (LPT), then micro-batches within each shard.
    assert [s.total_lengths.tolist() for s in token_shards] == [[1000, 400, 400], [400, 400, 400]]
    # FLOPs (slime): ceil(3000 / 1000) = 3 micro-batches by KK on FLOPs, split to 4 (a multiple of
    # DP), dealt two to each rank by KK on FLOPs; no filler, the shards' sizes may differ.
    assert groups == [[0, 4], [1, 5, 2, 3]]
    assert [s.total_lengths.tolist() for s in flops_shards] == [[1000, 400], [400, 400, 400, 400]]
    assert flops_plans == [[[0], [1]], [[0, 1], [2, 3]]]
    assert {len(p) for p in flops_plans} == {2}  # every rank runs as many micro-batches

    def rank_flops(shards: list[TrainBatch]) -> list[int]:
        return [sum(MODEL.of(int(n)) for n in s.total_lengths) for s in shards]

    assert max(rank_flops(flops_shards)) < max(rank_flops(token_shards))
    assert spread(rank_flops(flops_shards)) < spread(rank_flops(token_shards))
    assert token_plans != flops_plans


def test_flops_micro_batches_may_exceed_the_token_cap_as_in_slime() -> None:
    # 2200 tokens under a 1100 cap: two micro-batches, balanced by FLOPs, the second over the cap.
    assert flops_balanced_schedule([1000, 600, 600], 1, 1100, MODEL) == [[[0], [1, 2]]]
    assert len(plan_micro_batches([batch_of([1000, 600, 600])], max_tokens_per_gpu=1100)[0]) == 3
    # One micro-batch per sample when the cap asks for as many; 3 cannot become a multiple of DP 2.
    with pytest.raises(ValueError, match="--balance-by-flops: a step of 3 samples"):
        flops_balanced_schedule([1000, 1000, 1000], 2, 1000, MODEL)


def write_hf_config(path: Path) -> Path:
    config = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_flag_reaches_the_planner_from_a_real_config(tmp_path: Path) -> None:
    from tether.run.trainer_pool import TrainerPool

    hf = str(write_hf_config(tmp_path))
    argv = ["--hf-checkpoint", hf, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]
    argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "30"]
    plain = resolve(argv)
    cfg = resolve([*argv, "--balance-by-flops"])
    assert cfg.data.balance_by_flops and cfg.data.balance_data  # slime: the flag implies --balance-data
    # The head's options for each rollout (TrainerPool._work_options reads the model's shape).
    options = TrainerPool._work_options(SimpleNamespace(cfg=cfg))  # type: ignore[arg-type]
    assert options.flops == MODEL
    assert TrainerPool._work_options(SimpleNamespace(cfg=plain)).flops is None  # type: ignore[arg-type]

    lengths = [30, 6, 6, 6, 6, 6, 6, 6]
    groups = [
        [
            Sample(
                index=i,
                group_index=g,
                rollout_id=i,
                tokens=[1 + i % 7] * lengths[i],
                response_length=3,
                loss_mask=[1, 1, 1],
                reward=float(i % 2),
            )
            for i in (2 * g, 2 * g + 1)
        ]
        for g in range(4)
    ]
    (step,) = rollout_steps(groups, AlgorithmConfig(), options, dp_size=2)
    schedule = flops_balanced_schedule(lengths, 2, 30, MODEL)
    assert [s.total_lengths.tolist() for s in step.shards] == [
        [lengths[i] for mb in rank for i in mb] for rank in schedule
    ]
    assert [len(p) for p in step.plans] == [len(rank) for rank in schedule]
    (plain_step,) = rollout_steps(
        groups, AlgorithmConfig(), WorkOptions.from_config(plain.data, None), dp_size=2
    )
    assert [s.num_samples for s in plain_step.shards] == [4, 4]  # round-robin, equal counts
    assert [s.num_samples for s in step.shards] != [4, 4]  # the 30-token sample's rank takes fewer
    assert np.isclose(sum(float(s.loss_weights.sum() * 3) for s in step.shards), 1.0)  # no filler


def test_the_flag_is_refused_without_dynamic_batches_or_a_model_shape() -> None:
    with pytest.raises(ConfigError) as err:
        resolve(["--balance-by-flops"])
    assert (err.value.key, err.value.value) == ("--balance-by-flops", True)
    assert "--use-dynamic-batch-size" in str(err.value)
    cfg = resolve(["--balance-by-flops", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    with pytest.raises(ConfigError, match="model's shape"):
        WorkOptions.from_config(cfg.data, None)


def test_the_ppo_critic_uses_the_same_flops_schedule() -> None:
    from tether.train.algorithms.critic_work import CriticWork

    lengths = [30, 6, 6, 6, 6, 6, 6, 6]
    groups = [
        [
            Sample(
                index=i, group_index=i // 2, rollout_id=i, tokens=[1 + i] * n, response_length=3, reward=1.0
            )
            for i, n in list(enumerate(lengths))[2 * g : 2 * g + 2]
        ]
        for g in range(4)
    ]
    options = WorkOptions(global_batch_size=8, max_tokens_per_gpu=30, flops=MODEL)
    work = CriticWork.build(groups, AlgorithmConfig(advantage_estimator="ppo"), options, dp_size=2)
    schedule = flops_balanced_schedule(lengths, 2, 30, MODEL)
    requests = work.value_requests()
    assert [[int(r.shard.tokens[o]) - 1 for o in r.shard.offsets[:-1]] for r in requests] == [
        [i for mb in rank for i in mb] for rank in schedule
    ]
    # Each rank's values go back to their samples (a value per response token: its sample's index).
    values = work.with_values([np.repeat(r.shard.tokens[r.shard.offsets[:-1]] - 1, 3) for r in requests])
    assert values.tolist() == np.repeat(np.arange(8), 3).tolist()
    assert [len(req.plan) for req in work.train_requests(0)[0]] == [len(rank) for rank in schedule]


def test_the_log_prob_passes_run_the_flops_micro_batches() -> None:
    # slime has one schedule for a rollout; a token re-plan at --log-probs-max-tokens-per-gpu could
    # ask a FLOPs shard (here one 30-token sample) for more micro-batches than it has samples.
    lengths = [30, 6, 6, 6, 6, 6, 6, 6]
    groups = [
        [Sample(index=i, rollout_id=i, tokens=[1 + i] * n, response_length=3, reward=1.0)]
        for i, n in enumerate(lengths)
    ]
    algorithm = AlgorithmConfig(log_probs_max_tokens_per_gpu=12)
    options = WorkOptions(global_batch_size=4, max_tokens_per_gpu=30, flops=MODEL)
    steps = rollout_steps(groups, algorithm, options, dp_size=2)
    assert len(steps) == 2 and all(s.log_prob_models == ("actor",) for s in steps)
    assert all(s.log_prob_plans == s.plans for s in steps)
    assert [s.num_samples for s in steps[0].shards] == [1, 3]

"""The trainer's config slices: slime's defaults, ranges, and contradictions named by flag."""

from __future__ import annotations

import msgspec
import pytest

from tether.runtime.errors import ConfigError
from tether.train.config import (
    ARCHITECTURE_FIELDS,
    AlgorithmConfig,
    MegatronConfig,
    check_algorithm_against_megatron,
)


def test_defaults_follow_slime() -> None:
    a = AlgorithmConfig()
    assert (a.advantage_estimator, a.loss_type, a.eps_clip, a.eps_clip_high, a.clip_high) == (
        "grpo",
        "policy_loss",
        0.2,
        None,
        0.2,
    )
    assert (a.kl_loss_type, a.kl_loss_coef, a.kl_coef, a.entropy_coef) == ("k1", 0.0, 0.0, 0.0)
    assert (a.tis_clip, a.tis_clip_low, a.gamma, a.lambd, a.lr, a.seed) == (2.0, 0.0, 1.0, 1.0, 1e-6, 1234)
    assert not a.per_rollout_loss_mean and not a.needs_ref_log_probs
    m = MegatronConfig()
    assert (m.tensor_model_parallel_size, m.clip_grad, m.optimizer, m.adam_beta2) == (1, 1.0, "adam", 0.999)
    assert m.architecture() == {}


def test_every_field_has_help_text_and_a_default() -> None:
    for cls in (AlgorithmConfig, MegatronConfig):
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        for f in info.fields:
            assert not f.required, f.name
            assert isinstance(f.type, msgspec.inspect.Metadata), f"{cls.__name__}.{f.name} has no Meta"
            schema = f.type.extra_json_schema or {}
            assert schema.get("description"), f"{cls.__name__}.{f.name} has no description"


@pytest.mark.parametrize(
    ("cls", "kwargs", "flag"),
    [
        (AlgorithmConfig, {"eps_clip_c": 1.0}, "--eps-clip-c"),
        (AlgorithmConfig, {"loss_type": "custom_loss"}, "--custom-loss-function-path"),
        (AlgorithmConfig, {"kl_coef": 0.1, "kl_loss_coef": 0.1, "use_kl_loss": True}, "--kl-coef"),
        (AlgorithmConfig, {"kl_loss_coef": 0.1}, "--kl-loss-coef"),
        (AlgorithmConfig, {"advantage_estimator": "reinforce_plus_plus"}, "--advantage-estimator"),
        (AlgorithmConfig, {"use_tis": True, "use_rollout_logprobs": True}, "--use-tis"),
        (AlgorithmConfig, {"tis_clip": 1.0, "tis_clip_low": 2.0}, "--tis-clip-low"),
        (AlgorithmConfig, {"save_interval": 5}, "--save-interval"),
        (AlgorithmConfig, {"save_interval": 0, "save": "/x"}, "--save-interval"),
        (MegatronConfig, {"bf16": True, "fp16": True}, "--fp16"),
        (MegatronConfig, {"recompute_granularity": "full"}, "--recompute-granularity"),
        (MegatronConfig, {"recompute_method": "uniform"}, "--recompute-method"),
        (MegatronConfig, {"num_attention_heads": 8, "num_query_groups": 3}, "--num-query-groups"),
        (
            MegatronConfig,
            {"num_attention_heads": 3, "tensor_model_parallel_size": 2},
            "--num-attention-heads",
        ),
        (MegatronConfig, {"num_layers": 3, "pipeline_model_parallel_size": 2}, "--num-layers"),
        (MegatronConfig, {"rotary_percent": 1.5}, "--rotary-percent"),
        (MegatronConfig, {"norm_epsilon": 0.0}, "--norm-epsilon"),
    ],
)
def test_contradictions_name_the_flag(cls: type, kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.key == flag
    with pytest.raises(msgspec.ValidationError, match=flag):  # the same from YAML / argument dicts
        msgspec.convert(kwargs, cls)


def test_a_slime_script_parses() -> None:
    algo = msgspec.convert(
        {
            "advantage_estimator": "grpo",
            "use_kl_loss": True,
            "kl_loss_coef": 0.0,
            "kl_loss_type": "low_var_kl",
            "entropy_coef": 0.0,
            "eps_clip": 0.2,
            "eps_clip_high": 0.28,
            "lr": 1e-6,
        },
        AlgorithmConfig,
    )
    assert algo.clip_high == 0.28 and algo.needs_ref_log_probs
    meg = msgspec.convert(
        {
            "tensor_model_parallel_size": 2,
            "swiglu": True,
            "num_layers": 36,
            "hidden_size": 2560,
            "ffn_hidden_size": 9728,
            "num_attention_heads": 32,
            "group_query_attention": True,
            "num_query_groups": 8,
            "use_rotary_position_embeddings": True,
            "disable_bias_linear": True,
            "normalization": "RMSNorm",
            "norm_epsilon": 1e-6,
            "rotary_base": 1000000,
            "vocab_size": 151936,
            "kv_channels": 128,
            "qk_layernorm": True,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "accumulate_allreduce_grads_in_fp32": True,
            "attention_softmax_in_fp32": True,
            "attention_backend": "flash",
            "optimizer": "adam",
            "lr_decay_style": "constant",
            "weight_decay": 0.1,
            "adam_beta1": 0.9,
            "adam_beta2": 0.98,
        },
        MegatronConfig,
    )
    arch = meg.architecture()
    assert arch["num_query_groups"] == 8 and arch["qk_layernorm"] is True and "add_qkv_bias" not in arch
    assert set(arch) <= set(ARCHITECTURE_FIELDS)
    assert meg.data_parallel_size(8) == 4
    with pytest.raises(ConfigError, match="must divide"):
        meg.data_parallel_size(3)
    # The experts' own grid: EP x ETP x PP tiles the ranks as TP x PP x CP does (slime's EP=8, ETP=1
    # under TP=2 needs a multiple of 8 ranks).
    moe = MegatronConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=8,
        expert_tensor_parallel_size=1,
    )
    assert moe.data_parallel_size(16) == 8
    with pytest.raises(ConfigError, match=r"EP x ETP x PP = 8 must divide the 4 trainer ranks") as err:
        moe.data_parallel_size(4)
    assert err.value.key == "--expert-model-parallel-size"
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"no_such_flag": 1}, MegatronConfig)


def test_cross_slice_check() -> None:
    with pytest.raises(ConfigError, match="--calculate-per-token-loss"):
        check_algorithm_against_megatron(
            AlgorithmConfig(per_rollout_loss_mean=True), MegatronConfig(calculate_per_token_loss=True)
        )
    check_algorithm_against_megatron(AlgorithmConfig(), MegatronConfig(calculate_per_token_loss=True))

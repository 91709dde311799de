"""The Megatron flags reach Megatron: from the parsed command line, the TransformerConfig, DDP
config, OptimizerConfig and LR scheduler a trainer rank would build (pure builders, no
torch.distributed), per flag group; flags a run cannot honour are refused at parse time with the
flag, the value and what is missing. The last test walks every flag of the Megatron section.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.config import Config, flag_specs, resolve
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig, stage_layers
from tether.train.model import megatron_args
from tether.train.model.capabilities import Capabilities, check_capabilities
from tether.train.model.hf_config import ModelArch, check_architecture_flags

with warnings.catch_warnings():
    # torch.compile machinery imported by megatron.core warns about torch's own deprecations.
    warnings.simplefilter("ignore")
    import megatron.core.distributed
    import megatron.core.optimizer
    import megatron.core.optimizer_param_scheduler  # noqa: F401
    from megatron.core.transformer.enums import AttnBackend

# A tiny Llama shape (what `tether init-model` writes, with 4 layers), built without files.
ARCH = ModelArch(
    model_type="llama",
    vocab_size=320,
    hidden_size=64,
    ffn_hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    norm_epsilon=1e-6,
    rope_theta=10000.0,
    rope_scaling_factor=None,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    qkv_bias=False,
    qk_layernorm=False,
)
MHA = dataclasses.replace(ARCH, num_query_groups=4)
# A tiny GLM-4 dense shape: sandwich norms, interleaved half RoPE, q/k/v biases.
GLM4 = dataclasses.replace(
    ARCH,
    model_type="glm4",
    qkv_bias=True,
    rotary_percent=0.5,
    rotary_interleaved=True,
    post_sublayer_norms=True,
)
TIED = dataclasses.replace(ARCH, tie_word_embeddings=True)
# Qwen3-Next's attention and norms (its linear attention and experts do not matter to these flags).
QWEN3_NEXT = dataclasses.replace(
    ARCH, model_type="qwen3_next", attention_output_gate=True, zero_centered_norms=True
)
# A tiny DeepSeek-V3 shape (MLA + MoE with grouped, biased sigmoid routing), as hf_config reads it.
# MiMo: the dense shape plus one multi-token-prediction layer in the checkpoint.
MIMO = dataclasses.replace(ARCH, model_type="mimo", mtp_layers=1)
MOE = dataclasses.replace(
    ARCH,
    model_type="deepseek_v3",
    num_query_groups=4,
    qk_layernorm=True,
    head_dim=24,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_layer_freq=(0, 1, 1, 1),
    moe_router_score_function="sigmoid",
    moe_router_pre_softmax=True,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
    moe_router_enable_expert_bias=True,
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
)
# DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): the MLA shape with an indexer on every layer.
SPARSE = dataclasses.replace(
    MOE, index_heads=2, index_head_dim=16, index_topk=4, index_shared=(False,) * MOE.num_layers
)
CPU = Capabilities.cpu()
GPU = Capabilities.full_gpu()
# Steps are known (--train-iters derives from --num-rollout), so the default linear schedule builds.
RUN = ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]


def parse(*argv: str) -> Config:
    return resolve([*RUN, *argv])


def transformer(cfg: Config, caps: Capabilities = CPU) -> Any:
    """The TransformerConfig a rank builds (real Megatron object; CPU capabilities)."""
    m = cfg.megatron
    arch = megatron_args.resolve_arch(
        ARCH, m, tp_size=m.tensor_model_parallel_size, pp_size=m.pipeline_model_parallel_size
    )
    return megatron_args.transformer_config(
        arch, m, caps, tp_size=m.tensor_model_parallel_size, pp_size=m.pipeline_model_parallel_size
    )


def lrs(cfg: Config, steps: int) -> list[float]:
    """The learning rate of each of `steps` optimizer steps under the scheduler a rank builds."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = megatron_args.build_scheduler(opt, cfg.megatron, cfg.algorithm)
    out = []
    for _ in range(steps):
        out.append(float(opt.param_groups[0]["lr"]))
        scheduler.step(increment=1)
    return out


def refused(argv: list[str], flag: str, *words: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert err.value.key == flag, err.value
    for word in words:
        assert word in str(err.value), err.value
    return err.value


# --- recompute --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "fields"),
    [
        ([], (None, None, None)),
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            ("full", "uniform", 1),
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
            ("full", "block", 3),
        ),
        (["--recompute-granularity", "selective"], ("selective", None, None)),
    ],
)
# Megatron warns, for selective recompute, that TE's fused attention needs none: its own advice.
@pytest.mark.filterwarnings("ignore:If you are using transformer_engine:UserWarning")
def test_recompute_reaches_the_transformer_config(argv: list[str], fields: tuple[object, ...]) -> None:
    tc = transformer(parse(*argv))
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == fields
    if fields[0] == "selective":
        assert tc.recompute_modules == ["core_attn"]  # Megatron's default for selective


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--recompute-granularity", "full"], "--recompute-granularity"),
        (["--recompute-method", "block"], "--recompute-method"),
        (["--recompute-num-layers", "2"], "--recompute-num-layers"),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "--recompute-num-layers"),
    ],
)
def test_recompute_combinations_megatron_refuses(argv: list[str], flag: str) -> None:
    refused(argv, flag)


# --- sequence parallelism -----------------------------------------------------------------


def test_sequence_parallel_reaches_the_config_at_tp2_and_is_off_at_tp1() -> None:
    assert transformer(parse("--tensor-model-parallel-size", "2", "--sequence-parallel")).sequence_parallel
    # Megatron-LM turns it off at TP = 1 (nothing to split over); slime scripts pass it there.
    assert not transformer(parse("--sequence-parallel")).sequence_parallel
    micro = megatron_args.sequence_multiple
    assert micro(transformer(parse("--tensor-model-parallel-size", "2", "--sequence-parallel"))) == 2
    assert micro(transformer(parse("--tensor-model-parallel-size", "2"))) == 1


@pytest.mark.parametrize(
    ("argv", "multiple"),
    [
        ([], 1),  # unset: padding only to the longest sample (slime's 128 would pad every row)
        (["--data-pad-size-multiplier", "128"], 128),  # slime's default, given
        (["--data-pad-size-multiplier", "4", "--tensor-model-parallel-size", "2"], 8),  # TP x 4, SP or not
        # CP 2: each rank's half a multiple of 3, and 2 x CP chunks: lcm(4, 2 x 3)
        (["--data-pad-size-multiplier", "3", "--context-parallel-size", "2"], 12),
        # CP 2, TP 2 + SP: the CP chunks split over TP (8) already hold CP x TP x 1
        (
            [
                *("--data-pad-size-multiplier", "1", "--context-parallel-size", "2"),
                *("--tensor-model-parallel-size", "2", "--sequence-parallel"),
            ],
            8,
        ),
    ],
)
def test_data_pad_size_multiplier_pads_the_micro_batches(argv: list[str], multiple: int) -> None:
    # slime pads each micro-batch's packed tokens (per CP rank) to a multiple of TP x the multiplier
    # (backends/megatron_utils/data.py get_batch); tether pads the sequence dimension the same way.
    from support.train_checks.launcher import make_batch

    from tether.train.rank.step import build_micro_batches

    tc = transformer(parse(*argv))
    assert megatron_args.micro_batch_multiple(tc) == multiple
    shard = make_batch(4, seed=3)
    longest = [int(shard.total_lengths[[0, 1]].max()), int(shard.total_lengths[[2, 3]].max())]
    mbs = build_micro_batches(shard, [[0, 1], [2, 3]], config=tc)
    padded = [-(-n // multiple) * multiple for n in longest]
    assert [mb.tokens.shape[1] for mb in mbs] == padded
    assert sum(mb.num_tokens for mb in mbs) == shard.num_tokens  # the padding holds no token
    refused(["--data-pad-size-multiplier", "0"], "--data-pad-size-multiplier")


def test_sequence_parallel_runs_without_transformer_engine() -> None:
    # The local spec's norms accept sequence parallelism (tether.train.model.spec), so CPU plans
    # and GPU ranks without TE run it as TE's spec does.
    cfg = parse("--cpu-devices", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert transformer(cfg).sequence_parallel
    gpu_without_te = dataclasses.replace(GPU, transformer_engine=False)
    check_capabilities(cfg.megatron, gpu_without_te)
    check_capabilities(cfg.megatron, Capabilities.cpu())


# --- precision and loss scaling ---------------------------------------------------------


def test_bf16_and_fp16_reach_transformer_optimizer_and_ddp_configs() -> None:
    algo = AlgorithmConfig()
    for flag, dtype in (("--bf16", torch.bfloat16), ("--fp16", torch.float16)):
        cfg = parse(flag)
        tc = transformer(cfg)
        assert (tc.params_dtype, tc.pipeline_dtype, tc.bf16, tc.fp16) == (
            dtype,
            dtype,
            flag == "--bf16",
            flag == "--fp16",
        )
        oc = megatron_args.optimizer_config(cfg.megatron, algo)
        assert (oc.params_dtype, oc.bf16, oc.fp16) == (dtype, flag == "--bf16", flag == "--fp16")
    assert transformer(parse()).params_dtype == torch.float32
    # Megatron-LM reduces bf16 gradients in fp32 always, fp16 ones when asked.
    assert megatron_args.ddp_config(parse("--bf16").megatron).grad_reduce_in_fp32
    assert not megatron_args.ddp_config(parse("--fp16").megatron).grad_reduce_in_fp32
    assert not megatron_args.ddp_config(parse().megatron).grad_reduce_in_fp32
    assert megatron_args.ddp_config(
        parse("--accumulate-allreduce-grads-in-fp32").megatron
    ).grad_reduce_in_fp32


def test_loss_scaling_reaches_the_optimizer_config() -> None:
    argv = ["--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "4"]
    argv += ["--loss-scale-window", "50", "--hysteresis", "3"]
    oc = megatron_args.optimizer_config(parse(*argv).megatron, AlgorithmConfig())
    assert (oc.loss_scale, oc.initial_loss_scale, oc.min_loss_scale) == (None, 65536.0, 4.0)
    assert (oc.loss_scale_window, oc.hysteresis) == (50.0, 3)
    oc = megatron_args.optimizer_config(parse("--bf16", "--loss-scale", "128").megatron, AlgorithmConfig())
    assert oc.loss_scale == 128.0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--bf16", "--fp16"], "--fp16"),
        (["--loss-scale", "128"], "--loss-scale"),
        (["--initial-loss-scale", "1024"], "--initial-loss-scale"),
        (["--bf16", "--hysteresis", "4"], "--hysteresis"),
        (["--fp16", "--loss-scale", "8", "--min-loss-scale", "2"], "--min-loss-scale"),
    ],
)
def test_loss_scaling_without_its_precision_is_refused(argv: list[str], flag: str) -> None:
    refused(argv, flag)


def test_mixed_precision_runs_on_cpu() -> None:
    # Measured: Megatron trains in bf16 and fp16 (dynamic loss scaling) on CPU over gloo
    # (tests/integration/test_train_megatron_flags.py), so a CPU plan accepts them.
    assert parse("--cpu-devices", "2", "--bf16").megatron.bf16
    assert parse("--cpu-devices", "2", "--fp16").megatron.fp16


# --- attention, dropout, fusions ----------------------------------------------------------


def test_attention_backend_dropout_and_softmax() -> None:
    assert transformer(parse()).attention_backend == AttnBackend.auto
    assert transformer(parse("--attention-backend", "local")).attention_backend == AttnBackend.local
    tc = transformer(parse("--attention-dropout", "0.1", "--hidden-dropout", "0.2"))
    assert (tc.attention_dropout, tc.hidden_dropout) == (0.1, 0.2)
    assert transformer(parse("--attention-softmax-in-fp32")).attention_softmax_in_fp32
    assert not transformer(parse()).attention_softmax_in_fp32  # Megatron-LM's flag default
    kwargs = megatron_args.transformer_config_kwargs(parse("--use-flash-attn").megatron, GPU, tp_size=1)
    assert kwargs["attention_backend"] == AttnBackend.flash


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--attention-backend", "flash"], "--attention-backend"),
        (["--attention-backend", "fused"], "--attention-backend"),
        (["--use-flash-attn"], "--use-flash-attn"),
    ],
)
def test_te_attention_refused_on_cpu(argv: list[str], flag: str) -> None:
    refused(["--cpu-devices", "2", *argv], flag, "TransformerEngine")
    parse(*argv)  # a GPU plan: the ranks check TE when they start


def test_no_position_embedding() -> None:
    # glm4.7's MODEL_ARGS pass it beside --position-embedding-type rope, which Megatron-LM accepts.
    cfg = parse("--position-embedding-type", "rope", "--no-position-embedding")
    assert cfg.megatron.no_position_embedding
    parse("--use-rotary-position-embeddings", "--no-position-embedding")
    refused(["--no-position-embedding"], "--no-position-embedding", "--position-embedding-type rope")


def test_flash_flag_contradicting_the_backend_is_refused() -> None:
    refused(["--use-flash-attn", "--attention-backend", "local"], "--use-flash-attn")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ],
)
def test_fusion_flags(flag: str, field: str) -> None:
    def fused(argv: list[str], caps: Capabilities) -> bool:
        return bool(megatron_args.transformer_config_kwargs(parse(*argv).megatron, caps, tp_size=1)[field])

    assert fused([], GPU) and not fused([flag], GPU)  # Megatron's default on, the flag turns it off
    assert not fused([], CPU) and not fused([flag], CPU)  # no kernel on CPU: off either way, no crash
    assert getattr(transformer(parse(flag)), field) is False


# A GPU rank with TransformerEngine but without Apex (no fused_weight_gradient_mlp_cuda).
TE_WITHOUT_APEX = dataclasses.replace(GPU, fused_wgrad_kernels=False)
YARN = (
    ("rotary_scaling_factor", 40.0),
    ("original_max_position_embeddings", 4096.0),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)
MLA_YARN = dataclasses.replace(MOE, yarn=YARN)


@pytest.mark.parametrize("backend", [[], ["--attention-backend", "local"]], ids=["te-spec", "local-spec"])
def test_gradient_accumulation_fusion_follows_apex_kernel(backend: list[str]) -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    def fused(caps: Capabilities) -> bool:
        kwargs = megatron_args.transformer_config_kwargs(parse(*backend).megatron, caps, tp_size=1)
        return bool(kwargs["gradient_accumulation_fusion"])

    assert fused(GPU) and not fused(TE_WITHOUT_APEX)  # TE's layers or not: Apex's kernel decides
    # The output layer is Megatron's ColumnParallelLinear under TE's spec too: it builds from the
    # resolved config here (no Apex in this environment), where it would raise with the fusion on.
    # (--no-rope-fusion: TE's RoPE kernel, which the faked capabilities claim, is absent on CPU.)
    config = transformer(parse("--no-rope-fusion", *backend), TE_WITHOUT_APEX)
    assert config.gradient_accumulation_fusion is False
    layer = ColumnParallelLinear(
        ARCH.hidden_size, ARCH.vocab_size, config=config, init_method=config.init_method, bias=False
    )
    assert layer.gradient_accumulation_fusion is False


def test_rope_fusion_for_mla_only_with_yarn() -> None:
    # Megatron's fused RoPE for MLA is its YaRN kernel; MLATransformerConfig refuses the fusion
    # with plain RoPE ("apply_rope_fusion for MLA only works with YARN RoPE").
    assert megatron_args.rope_fusion_fits(ARCH) and megatron_args.rope_fusion_fits(MLA_YARN)
    assert not megatron_args.rope_fusion_fits(MOE)
    plain = moe_transformer(parse(), MOE, TE_WITHOUT_APEX)
    assert (plain.rope_type, plain.apply_rope_fusion) == ("rope", False)
    with warnings.catch_warnings():
        # Megatron calls MLA's fused RoPE experimental (training only, which is what tether runs).
        warnings.filterwarnings("ignore", "apply_rope_fusion for multi-latent attention", UserWarning)
        yarn = moe_transformer(parse(), MLA_YARN, TE_WITHOUT_APEX)
    assert (yarn.rope_type, yarn.apply_rope_fusion, yarn.rotary_scaling_factor) == ("yarn", True, 40.0)
    # --no-rope-fusion still turns it off; without TE there is no fusion at all.
    assert not moe_transformer(parse("--no-rope-fusion"), MLA_YARN, TE_WITHOUT_APEX).apply_rope_fusion
    assert not moe_transformer(parse(), MLA_YARN, CPU).apply_rope_fusion


# --- DDP and optimizer --------------------------------------------------------------------


def test_ddp_config() -> None:
    ddp = megatron_args.ddp_config(
        parse("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather").megatron
    )
    assert (ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (
        True,
        True,
        True,
    )
    default = megatron_args.ddp_config(parse().megatron)
    assert (default.use_distributed_optimizer, default.overlap_grad_reduce, default.overlap_param_gather) == (
        False,
        False,
        False,
    )
    refused(["--overlap-param-gather"], "--overlap-param-gather", "--use-distributed-optimizer")
    refused(["--use-distributed-optimizer", "--overlap-param-gather"], "--overlap-param-gather")


def test_optimizer_config() -> None:
    algo = AlgorithmConfig(lr=3e-4)
    cfg = parse("--optimizer", "sgd", "--sgd-momentum", "0.5", "--weight-decay", "0.1", "--clip-grad", "0.5")
    oc = megatron_args.optimizer_config(cfg.megatron, algo)
    assert (oc.optimizer, oc.sgd_momentum, oc.lr, oc.weight_decay, oc.clip_grad) == (
        "sgd",
        0.5,
        3e-4,
        0.1,
        0.5,
    )
    cfg = parse(
        "--adam-beta1", "0.8", "--adam-beta2", "0.98", "--adam-eps", "1e-6", "--use-distributed-optimizer"
    )
    oc = megatron_args.optimizer_config(cfg.megatron, algo)
    assert (oc.optimizer, oc.adam_beta1, oc.adam_beta2, oc.adam_eps) == ("adam", 0.8, 0.98, 1e-6)
    assert oc.use_distributed_optimizer
    refused(["--optimizer", "sgd", "--adam-beta2", "0.98"], "--adam-beta2", "adam")
    refused(["--sgd-momentum", "0.5"], "--sgd-momentum", "sgd")
    refused(["--optimizer", "rmsprop"], "--optimizer")


def test_cpu_offload_and_precision_aware_optimizer() -> None:
    argv = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload"]
    argv += ["--optimizer-offload-fraction", "0.5", "--overlap-cpu-optimizer-d2h-h2d"]
    kwargs = megatron_args.optimizer_config_kwargs(parse(*argv).megatron, AlgorithmConfig())
    assert kwargs["use_precision_aware_optimizer"] and kwargs["optimizer_cpu_offload"]
    assert kwargs["optimizer_offload_fraction"] == 0.5 and kwargs["overlap_cpu_optimizer_d2h_h2d"]
    check_capabilities(parse(*argv).megatron, GPU)
    refused(["--cpu-devices", "2", *argv], "--optimizer-cpu-offload", "needs CUDA")
    refused(["--cpu-devices", "2", *argv[:2]], "--use-precision-aware-optimizer", "TransformerEngine")
    # Megatron runs the precision-aware optimizer only sharded; slime always shards, so the flag alone
    # turns the distributed optimizer on (slime's scripts/run-qwen3-32B.sh passes it alone).
    alone = megatron_args.optimizer_config_kwargs(
        parse("--use-precision-aware-optimizer").megatron, AlgorithmConfig()
    )
    assert alone["use_precision_aware_optimizer"] and alone["use_distributed_optimizer"]
    assert megatron_args.ddp_config_kwargs(parse("--use-precision-aware-optimizer").megatron)[
        "use_distributed_optimizer"
    ]
    assert not megatron_args.ddp_config_kwargs(parse().megatron)["use_distributed_optimizer"]
    refused(
        ["--use-distributed-optimizer", "--optimizer-cpu-offload"], "--optimizer-cpu-offload", "precision"
    )
    refused(["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d")
    refused(["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction")


def test_distributed_timeout_minutes_reaches_init_distributed() -> None:
    from tether.train.parallel import topology as parallel

    cfg = parse("--distributed-timeout-minutes", "45", "--seed", "7")
    kwargs = megatron_args.init_distributed_kwargs(cfg.megatron, cfg.algorithm)
    assert kwargs["timeout_minutes"] == 45 and kwargs["seed"] == 7
    default = megatron_args.init_distributed_kwargs(parse().megatron, parse().algorithm)
    assert default["timeout_minutes"] == 10  # slime's default (Megatron-LM's flag, reset by slime)
    # Every keyword is one init_distributed takes, so the worker's call binds them all.
    inspect.signature(parallel.init_distributed).bind(**kwargs)
    with pytest.raises(ConfigError):
        parse("--distributed-timeout-minutes", "0")


def test_deterministic_mode_reaches_megatron_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.train.parallel import topology as parallel

    on = megatron_args.transformer_config_kwargs(parse("--deterministic-mode").megatron, GPU, tp_size=1)
    off = megatron_args.transformer_config_kwargs(parse().megatron, GPU, tp_size=1)
    assert on["deterministic_mode"] and not off["deterministic_mode"]
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    saved_det = torch.backends.cudnn.deterministic
    try:
        torch.backends.cudnn.benchmark = True
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the environment's choice is kept
        monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
        parallel.use_deterministic_algorithms()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.backends.cudnn.deterministic = saved_det


# --- learning-rate schedule ---------------------------------------------------------------


def test_train_iters_derive_from_num_rollout() -> None:
    assert parse().megatron.train_iters == 10
    two_steps = parse("--global-batch-size", "4").megatron.train_iters
    assert two_steps == 20  # 8 samples a rollout, 4 a step
    assert parse("--train-iters", "7").megatron.train_iters == 7
    assert resolve([]).megatron.train_iters is None


def test_lr_schedules_follow_megatron() -> None:
    lr = ["--lr", "1e-3"]
    # Linear over --train-iters (10 here) to --min-lr, Megatron's default style.
    assert lrs(parse(*lr, "--min-lr", "1e-4"), 3) == pytest.approx([1e-3, 1e-3 - 0.9e-4, 1e-3 - 1.8e-4])
    assert lrs(parse(*lr, "--lr-decay-style", "constant"), 3) == pytest.approx([1e-3] * 3)
    # Warm-up from --lr-warmup-init over --lr-warmup-iters, then decay over --lr-decay-iters.
    got = lrs(parse(*lr, "--lr-warmup-iters", "2", "--lr-warmup-init", "1e-4", "--lr-decay-iters", "4"), 6)
    assert got == pytest.approx([1e-4, 5.5e-4, 1e-3, 5e-4, 0.0, 0.0])
    # --lr-warmup-fraction of the decay horizon (10 steps x 0.2 = 2).
    assert lrs(parse(*lr, "--lr-warmup-fraction", "0.2"), 3) == pytest.approx([0.0, 5e-4, 1e-3])
    cosine = lrs(parse(*lr, "--lr-decay-style", "cosine", "--lr-decay-iters", "2"), 3)
    assert cosine == pytest.approx([1e-3, 5e-4, 0.0])
    wsd = parse(*lr, "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style", "linear")
    assert lrs(wsd, 11)[-4:] == pytest.approx([1e-3, 1e-3, 5e-4, 0.0])
    isr = lrs(parse(*lr, "--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "1"), 5)
    assert isr == pytest.approx([0.0, 1e-3, 1e-3 / 2**0.5, 1e-3 / 3**0.5, 5e-4])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction"),
        (["--lr-warmup-init", "1e-7"], "--lr-warmup-init"),
        (["--lr-decay-style", "constant", "--min-lr", "1e-7"], "--min-lr"),
        (["--lr-decay-style", "constant", "--lr-decay-iters", "5"], "--lr-decay-iters"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style"),
        (["--lr-wsd-decay-iters", "3"], "--lr-wsd-decay-iters"),
        (["--lr-wsd-decay-style", "cosine"], "--lr-wsd-decay-style"),
        (["--lr-warmup-iters", "10"], "--lr-warmup-iters"),
        (["--min-lr", "1e-3", "--lr", "1e-4"], "--min-lr"),
    ],
)
def test_schedule_contradictions(argv: list[str], flag: str) -> None:
    refused(argv, flag)


def test_a_decaying_schedule_with_num_epoch_gets_its_horizon_when_the_run_counts_the_prompts() -> None:
    # Accepted at parse time; `tether run` counts --num-rollout before the trainer starts
    # (tests/unit/test_epoch_horizon.py).
    assert resolve(["--num-epoch", "2"]).megatron.train_iters is None
    assert resolve(["--num-epoch", "2", "--lr-decay-style", "constant"]).megatron.train_iters is None
    assert resolve(["--num-epoch", "2", "--lr-decay-iters", "50"]).megatron.lr_decay_horizon == 50
    with pytest.raises(ConfigError, match="--lr-decay-style"):  # a rank given no horizon refuses too
        megatron_args.scheduler_kwargs(MegatronConfig(), AlgorithmConfig())


# --- pipeline stages, sequence length, vocabulary, architecture -------------------------------


def test_uneven_pipeline_stages_reach_the_config() -> None:
    cfg = parse(
        "--pipeline-model-parallel-size",
        "2",
        "--decoder-first-pipeline-num-layers",
        "1",
        "--decoder-last-pipeline-num-layers",
        "3",
    )
    tc = transformer(cfg)
    assert (tc.num_layers_in_first_pipeline_stage, tc.num_layers_in_last_pipeline_stage) == (1, 3)
    assert stage_layers(4, 2, 1, 3, layers_flag="--num-layers") == [1, 3]
    assert stage_layers(7, 3, 1, None, layers_flag="--num-layers") == [1, 3, 3]
    assert stage_layers(8, 4, None, None, layers_flag="--num-layers") == [2, 2, 2, 2]
    refused(["--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline-num-layers", "> 1")
    refused(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers",
            "4",
            "--decoder-last-pipeline-num-layers",
            "4",
        ],
        "--decoder-last-pipeline-num-layers",
    )
    m = parse(
        "--actor-num-gpus-per-node",
        "3",
        "--pipeline-model-parallel-size",
        "3",
        "--decoder-first-pipeline-num-layers",
        "1",
    ).megatron
    with pytest.raises(ConfigError) as err:  # 3 layers left for 2 stages of the 4-layer model
        megatron_args.resolve_arch(ARCH, m, tp_size=1, pp_size=3)
    assert err.value.key == "--decoder-first-pipeline-num-layers"


def test_seq_length_and_max_positions() -> None:
    m = parse("--seq-length", "512").megatron
    assert megatron_args.max_sequence_length(ARCH, m) == 512
    assert megatron_args.max_sequence_length(ARCH, parse().megatron) == 2048
    with pytest.raises(ConfigError) as err:
        megatron_args.resolve_arch(ARCH, parse("--seq-length", "4096").megatron, tp_size=1, pp_size=1)
    assert err.value.key == "--seq-length" and "max_position_embeddings=2048" in str(err.value)
    with pytest.raises(ConfigError) as err:
        megatron_args.resolve_arch(
            ARCH, parse("--max-position-embeddings", "4096").megatron, tp_size=1, pp_size=1
        )
    assert err.value.key == "--max-position-embeddings"
    refused(["--seq-length", "64", "--rollout-max-context-len", "128"], "--seq-length", "128 tokens")
    refused(["--seq-length", "256", "--max-position-embeddings", "128"], "--seq-length")


def test_vocab_padding() -> None:
    arch = megatron_args.resolve_arch(
        ARCH, parse("--make-vocab-size-divisible-by", "128").megatron, tp_size=2, pp_size=1
    )
    assert arch.padded_vocab_size(2) == 512 and arch.padded_vocab_size(1) == 384
    assert (
        megatron_args.resolve_arch(ARCH, parse().megatron, tp_size=2, pp_size=1).padded_vocab_size(2) == 320
    )


def test_architecture_flags_are_checked_against_the_hf_config() -> None:
    ok = parse("--num-layers", "4", "--group-query-attention", "--num-query-groups", "2", "--swiglu")
    megatron_args.resolve_arch(ARCH, ok.megatron, tp_size=1, pp_size=1)
    with pytest.raises(ConfigError) as err:
        megatron_args.resolve_arch(
            TIED, parse("--untie-embeddings-and-output-weights").megatron, tp_size=1, pp_size=1
        )
    assert err.value.key == "--untie-embeddings-and-output-weights"
    for argv, flag in (
        (["--hidden-size", "128"], "--hidden-size"),
        (["--group-query-attention", "--num-query-groups", "4"], "--num-query-groups"),
    ):
        with pytest.raises(ConfigError) as err:
            megatron_args.resolve_arch(ARCH, parse(*argv).megatron, tp_size=1, pp_size=1)
        assert err.value.key == flag
    with pytest.raises(ConfigError) as err:
        megatron_args.resolve_arch(MHA, parse("--group-query-attention").megatron, tp_size=1, pp_size=1)
    assert err.value.key == "--group-query-attention"
    refused(["--num-query-groups", "2"], "--num-query-groups", "--group-query-attention")


# --- parallel sizes, per-token loss, and flags of other slices ------------------------------


def test_context_parallelism_reaches_megatron() -> None:
    # What it builds is tests/unit/test_train_context_parallel.py's.
    assert transformer(parse("--context-parallel-size", "2")).context_parallel_size == 2


def test_allgather_cp_is_for_sparse_attention_models_only() -> None:
    # slime's rule: the contiguous layout at CP > 1 only for DeepSeek sparse attention (the others'
    # attention takes Megatron's load-balanced chunks); at CP = 1 there is one share either way.
    cfg = parse("--context-parallel-size", "2", "--allgather-cp")
    assert cfg.megatron.allgather_cp
    assert megatron_args.init_distributed_kwargs(cfg.megatron, cfg.algorithm)["contiguous_context"]
    with pytest.raises(ConfigError, match="sparse-attention models only") as err:
        megatron_args.resolve_arch(MHA, cfg.megatron, tp_size=1, pp_size=1)
    assert err.value.key == "--allgather-cp"
    megatron_args.resolve_arch(SPARSE, cfg.megatron, tp_size=1, pp_size=1)
    megatron_args.resolve_arch(MHA, parse("--allgather-cp").megatron, tp_size=1, pp_size=1)


# --- mixture of experts and multi-latent attention -----------------------------------------


def moe_transformer(cfg: Config, arch: ModelArch = MOE, caps: Capabilities = CPU) -> Any:
    m = cfg.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    resolved = megatron_args.resolve_arch(arch, m, tp_size=tp, pp_size=pp)
    return megatron_args.transformer_config(resolved, m, caps, tp_size=tp, pp_size=pp)


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        ([], "moe_router_load_balancing_type", "aux_loss"),  # Megatron's defaults, unset
        ([], "moe_aux_loss_coeff", 0.0),
        ([], "moe_token_dispatcher_type", "allgather"),
        ([], "moe_router_dtype", None),
        ([], "moe_router_bias_update_rate", 1e-3),
        ([], "moe_grouped_gemm", False),
        (["--moe-router-load-balancing-type", "none"], "moe_router_load_balancing_type", "none"),
        (
            ["--moe-router-load-balancing-type", "seq_aux_loss"],
            "moe_router_load_balancing_type",
            "seq_aux_loss",
        ),
        (["--moe-aux-loss-coeff", "0.01"], "moe_aux_loss_coeff", 0.01),
        (["--moe-token-dispatcher-type", "alltoall"], "moe_token_dispatcher_type", "alltoall"),
        (["--moe-router-dtype", "fp32"], "moe_router_dtype", "fp32"),
        (["--moe-router-bias-update-rate", "0.01"], "moe_router_bias_update_rate", 0.01),
        (["--moe-token-drop-policy", "position"], "moe_token_drop_policy", "position"),
        (["--moe-router-pre-softmax"], "moe_router_pre_softmax", True),
        (["--rotary-scaling-factor", "1", "--mscale", "1.0", "--mscale-all-dim", "1.0"], "mscale", 1.0),
        (["--moe-router-num-groups", "2", "--kv-channels", "128", "--qk-layernorm"], "qk_layernorm", True),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "expert_tensor_parallel_size", 2),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "2",
            ],
            "expert_tensor_parallel_size",
            2,
        ),
        # slime's MoE recipes: experts unsplit (ETP=1) under TP=2
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "1",
            ],
            "expert_tensor_parallel_size",
            1,
        ),
        # Shape flags that agree with the HF config are accepted; the config is the HF one.
        (["--num-experts", "4", "--moe-router-topk", "2"], "num_moe_experts", 4),
        (["--moe-ffn-hidden-size", "32"], "moe_ffn_hidden_size", 32),
        (["--moe-shared-expert-intermediate-size", "32"], "moe_shared_expert_intermediate_size", 32),
        (["--moe-layer-freq", "[0]*1+[1]*3"], "moe_layer_freq", [0, 1, 1, 1]),
        (["--moe-router-score-function", "sigmoid"], "moe_router_score_function", "sigmoid"),
        (["--moe-router-enable-expert-bias"], "moe_router_enable_expert_bias", True),
        (["--moe-router-topk-scaling-factor", "2.5"], "moe_router_topk_scaling_factor", 2.5),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], "moe_router_group_topk", 1),
        (["--multi-latent-attention", "--q-lora-rank", "32"], "q_lora_rank", 32),
        (["--kv-lora-rank", "16"], "kv_lora_rank", 16),
        (["--qk-head-dim", "16"], "qk_head_dim", 16),
        (["--qk-pos-emb-head-dim", "8"], "qk_pos_emb_head_dim", 8),
        (["--v-head-dim", "16"], "v_head_dim", 16),
    ],
)
def test_moe_flags_reach_the_transformer_config(argv: list[str], field: str, value: object) -> None:
    assert getattr(moe_transformer(parse(*argv)), field) == value


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--num-experts", "8"], "--num-experts", ("has 4",)),
        (["--moe-router-topk", "4"], "--moe-router-topk", ("has 2",)),
        (["--moe-ffn-hidden-size", "64"], "--moe-ffn-hidden-size", ("has 32",)),
        (
            ["--moe-shared-expert-intermediate-size", "64"],
            "--moe-shared-expert-intermediate-size",
            ("has 32",),
        ),
        (["--moe-layer-freq", "1"], "--moe-layer-freq", ("[1, 1, 1, 1]", "[0, 1, 1, 1]")),
        (["--moe-layer-freq", "[0]*9"], "--moe-layer-freq", ("each of the 4 layers",)),
        (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq", ("list expression",)),
        (["--moe-router-score-function", "softmax"], "--moe-router-score-function", ("'sigmoid'",)),
        (["--moe-router-topk-scaling-factor", "1.0"], "--moe-router-topk-scaling-factor", ("2.5",)),
        (["--moe-router-num-groups", "4"], "--moe-router-num-groups", ("has 2",)),
        (
            ["--moe-router-num-groups", "2", "--moe-router-group-topk", "2"],
            "--moe-router-group-topk",
            ("has 1",),
        ),
        (["--q-lora-rank", "64"], "--q-lora-rank", ("has 32",)),
        (["--kv-lora-rank", "64"], "--kv-lora-rank", ("has 16",)),
        (["--qk-head-dim", "128"], "--qk-head-dim", ("has 16",)),
        (["--qk-pos-emb-head-dim", "64"], "--qk-pos-emb-head-dim", ("has 8",)),
        (["--v-head-dim", "128"], "--v-head-dim", ("has 16",)),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size", ("--sequence-parallel",)),
        (
            [
                "--actor-num-gpus-per-node",  # ranks that TP 2 and the experts' ETP 3 both tile
                "6",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "3",
            ],
            "--expert-tensor-parallel-size",
            ("must divide the experts' moe_intermediate_size=32",),
        ),
        (
            [
                "--actor-num-gpus-per-node",  # ranks that EP 3 tiles
                "3",
                "--expert-model-parallel-size",
                "3",
                "--moe-token-dispatcher-type",
                "alltoall",
            ],
            "--expert-model-parallel-size",
            ("4 experts",),
        ),
    ],
)
def test_moe_shape_flags_must_agree_with_the_hf_config(
    argv: list[str], flag: str, words: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as err:
        moe_transformer(parse(*argv))
    assert err.value.key == flag, err.value
    for word in words:
        assert word in str(err.value), err.value


def test_moe_flags_on_a_dense_model_are_refused() -> None:
    for argv, flag in (
        (["--num-experts", "4"], "--num-experts"),
        (["--multi-latent-attention"], "--multi-latent-attention"),
        (
            ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
            "--expert-model-parallel-size",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            moe_transformer(parse(*argv), ARCH)
        assert err.value.key == flag, err.value
    # Dense models keep no MoE field at all (Megatron's defaults).
    assert moe_transformer(parse("--moe-aux-loss-coeff", "0.1"), ARCH).moe_aux_loss_coeff == 0.0


def test_what_cpu_ranks_cannot_run_is_refused() -> None:
    refused(["--cpu-devices", "2", "--moe-grouped-gemm"], "--moe-grouped-gemm", "TE's GroupedLinear")
    refused(
        ["--cpu-devices", "2", "--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type", "DeepEP"
    )
    # slime's DeepSeek/Moonlight scripts: --moe-enable-deepep beside the flex dispatcher. A GPU rank
    # without the deep_ep module refuses it by name; with it, Megatron gets the flag.
    deepep = parse("--moe-enable-deepep", "--moe-token-dispatcher-type", "flex").megatron
    assert megatron_args.moe_config_kwargs(deepep)["moe_enable_deepep"] is True
    check_capabilities(deepep, GPU)
    with pytest.raises(ConfigError, match="deep_ep module"):
        check_capabilities(deepep, dataclasses.replace(GPU, deep_ep=False))
    # Expert parallelism runs on CPU too (gloo all-to-all; tests/integration/test_train_model.py).
    cpu_ep = (
        "--cpu-devices",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
    )
    assert moe_transformer(parse(*cpu_ep)).expert_model_parallel_size == 2
    # Megatron's default allgather dispatcher too: the ranks pad their micro-batches to one shape.
    allgather = moe_transformer(parse("--cpu-devices", "2", "--expert-model-parallel-size", "2"))
    assert allgather.moe_token_dispatcher_type == "allgather" and allgather.expert_model_parallel_size == 2
    refused(["--moe-router-group-topk", "1"], "--moe-router-group-topk", "--moe-router-num-groups")
    with pytest.raises(ConfigError, match="TE's GroupedLinear"):
        check_capabilities(
            parse("--moe-grouped-gemm").megatron, dataclasses.replace(GPU, transformer_engine=False)
        )
    check_capabilities(parse("--moe-grouped-gemm").megatron, GPU)


def test_per_token_loss_reaches_megatron() -> None:
    assert transformer(parse("--calculate-per-token-loss")).calculate_per_token_loss
    assert not transformer(parse()).calculate_per_token_loss
    refused(["--calculate-per-token-loss", "--per-rollout-loss-mean"], "--calculate-per-token-loss")


def test_lambd_is_refused_unless_one() -> None:
    refused(["--lambd", "0.95"], "--lambd", "critic")
    assert parse("--lambd", "1.0").algorithm.lambd == 1.0


def test_offload_train_needs_cuda() -> None:
    refused(["--cpu-devices", "2", "--offload-train"], "--offload-train", "needs CUDA")
    refused(["--cpu-devices", "2", "--offload"], "--offload", "needs CUDA")
    parse("--cpu-devices", "2", "--offload", "--no-offload-train")
    assert parse("--cpu-devices", "2", "--colocate").cluster.colocate  # implied: moot on CPU
    assert parse("--offload-train").cluster.offloads_train  # a GPU plan


def test_micro_batch_size_plans_the_micro_batches() -> None:
    # --micro-batch-size (the data slice) sizes the micro-batches each rank runs; the head passes
    # it to the ranks' micro-batch plan (WorkOptions.micro_batch_size → plan_micro_batches).
    from support.train_checks.launcher import make_batch

    from tether.train.rank.batching import plan_micro_batches

    size = parse("--micro-batch-size", "3").data.micro_batch_size
    plan = plan_micro_batches([make_batch(8, seed=1)], micro_batch_size=size)
    assert [len(mb) for mb in plan[0]] == [3, 3, 2]


# --- every flag of the Megatron section -----------------------------------------------------

# "consumed": a built config differs from the baseline's; "refused": a ConfigError names it;
# "checked": builds the same, a value the HF config contradicts refused.
Outcome = str


@dataclasses.dataclass(frozen=True)
class Probe:
    argv: list[str]
    expect: Outcome
    base: list[str] = dataclasses.field(default_factory=list)
    arch: ModelArch = ARCH


def flag(
    name: str, *values: str, expect: Outcome = "consumed", base: tuple[str, ...] = (), arch: ModelArch = ARCH
) -> Probe:
    return Probe([*base, name, *values], expect, list(base), arch)


FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
PP2 = ("--pipeline-model-parallel-size", "2")
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
CPU_PLAN = ("--cpu-devices", "2")
# Architecture flags that every model tether builds satisfies (SwiGLU, RoPE, no linear biases): set,
# they are checked against the HF config; their opposite is refused (asserted below).
ALWAYS_TRUE = {
    "--swiglu": "swiglu",
    "--use-rotary-position-embeddings": "use_rotary_position_embeddings",
    "--disable-bias-linear": "disable_bias_linear",
}

PROBES: dict[str, list[Probe]] = {
    # The micro-batches' padding (test_data_pad_size_multiplier_pads_the_micro_batches shows it).
    "--data-pad-size-multiplier": [flag("--data-pad-size-multiplier", "4")],
    "--tensor-model-parallel-size": [flag("--tensor-model-parallel-size", "2")],
    "--pipeline-model-parallel-size": [flag("--pipeline-model-parallel-size", "2")],
    "--decoder-first-pipeline-num-layers": [flag("--decoder-first-pipeline-num-layers", "1", base=PP2)],
    "--decoder-last-pipeline-num-layers": [flag("--decoder-last-pipeline-num-layers", "1", base=PP2)],
    "--context-parallel-size": [flag("--context-parallel-size", "2")],
    "--enable-experimental": [flag("--enable-experimental")],
    "--allgather-cp": [
        flag("--allgather-cp", base=("--context-parallel-size", "2"), arch=SPARSE),
        flag("--allgather-cp", base=("--context-parallel-size", "2"), expect="refused"),
    ],
    "--expert-model-parallel-size": [
        flag("--expert-model-parallel-size", "2", base=("--moe-token-dispatcher-type", "alltoall"), arch=MOE),
        flag("--expert-model-parallel-size", "2", arch=MOE),
        flag(
            "--expert-model-parallel-size",
            "2",
            base=("--moe-token-dispatcher-type", "alltoall"),
            expect="refused",
        ),
    ],
    "--expert-tensor-parallel-size": [
        flag("--expert-tensor-parallel-size", "2", base=(*TP2_SP,), arch=MOE),
        flag("--expert-tensor-parallel-size", "1", base=(*TP2_SP,), arch=MOE),  # slime's MoE layout
        flag("--expert-tensor-parallel-size", "2", expect="refused"),
    ],
    "--sequence-parallel": [
        flag("--sequence-parallel", base=("--tensor-model-parallel-size", "2")),
        flag("--sequence-parallel", base=(*CPU_PLAN, "--tensor-model-parallel-size", "2")),
    ],
    "--moe-router-load-balancing-type": [flag("--moe-router-load-balancing-type", "none", arch=MOE)],
    "--moe-aux-loss-coeff": [flag("--moe-aux-loss-coeff", "0.01", arch=MOE)],
    "--moe-grouped-gemm": [
        flag("--moe-grouped-gemm", arch=MOE),
        flag("--moe-grouped-gemm", base=CPU_PLAN, expect="refused", arch=MOE),
    ],
    "--moe-token-dispatcher-type": [
        flag("--moe-token-dispatcher-type", "alltoall", arch=MOE),
        flag("--moe-token-dispatcher-type", "flex", base=CPU_PLAN, expect="refused", arch=MOE),
    ],
    # slime's kernel choice for Qwen3-Next/Qwen3.5's linear attention (FlashQLA needs CUDA and flash_qla).
    "--qwen-gdn-backend": [
        flag("--qwen-gdn-backend", "flashqla"),
        flag("--qwen-gdn-backend", "flashqla", base=CPU_PLAN, expect="refused"),
    ],
    "--moe-enable-deepep": [
        flag("--moe-enable-deepep", base=("--moe-token-dispatcher-type", "flex"), arch=MOE),
        flag("--moe-enable-deepep", expect="refused", arch=MOE),  # not the flex dispatcher
        flag(
            "--moe-enable-deepep", base=(*CPU_PLAN, "--moe-token-dispatcher-type", "flex"), expect="refused"
        ),
    ],
    "--moe-router-dtype": [flag("--moe-router-dtype", "fp32", arch=MOE)],
    "--moe-router-bias-update-rate": [flag("--moe-router-bias-update-rate", "0.01", arch=MOE)],
    "--moe-permute-fusion": [
        flag("--moe-permute-fusion", arch=MOE),
        flag("--moe-permute-fusion", base=CPU_PLAN, expect="refused", arch=MOE),
    ],
    "--moe-token-drop-policy": [flag("--moe-token-drop-policy", "position", arch=MOE)],
    "--moe-router-pre-softmax": [flag("--moe-router-pre-softmax", expect="refused")],
    "--rotary-scaling-factor": [flag("--rotary-scaling-factor", "40", expect="refused", arch=MOE)],
    "--mscale": [flag("--mscale", "0.707", expect="refused", arch=MOE)],
    "--mscale-all-dim": [flag("--mscale-all-dim", "0.707", expect="refused", arch=MOE)],
    "--num-experts": [
        flag("--num-experts", "8", expect="refused", arch=MOE),
        flag("--num-experts", "4", expect="refused"),
    ],
    "--moe-router-topk": [flag("--moe-router-topk", "4", expect="refused", arch=MOE)],
    "--moe-ffn-hidden-size": [flag("--moe-ffn-hidden-size", "64", expect="refused", arch=MOE)],
    "--moe-shared-expert-intermediate-size": [
        flag("--moe-shared-expert-intermediate-size", "64", expect="refused", arch=MOE)
    ],
    "--moe-layer-freq": [flag("--moe-layer-freq", "1", expect="refused", arch=MOE)],
    "--moe-router-score-function": [
        flag("--moe-router-score-function", "softmax", expect="refused", arch=MOE)
    ],
    "--moe-router-enable-expert-bias": [flag("--moe-router-enable-expert-bias", expect="refused")],
    "--moe-router-topk-scaling-factor": [
        flag("--moe-router-topk-scaling-factor", "1.0", expect="refused", arch=MOE)
    ],
    "--moe-router-num-groups": [flag("--moe-router-num-groups", "4", expect="refused", arch=MOE)],
    "--moe-router-group-topk": [
        flag(
            "--moe-router-group-topk", "2", base=("--moe-router-num-groups", "2"), expect="refused", arch=MOE
        )
    ],
    "--multi-latent-attention": [flag("--multi-latent-attention", expect="refused")],
    "--q-lora-rank": [flag("--q-lora-rank", "64", expect="refused", arch=MOE)],
    "--kv-lora-rank": [flag("--kv-lora-rank", "64", expect="refused", arch=MOE)],
    "--qk-head-dim": [flag("--qk-head-dim", "128", expect="refused", arch=MOE)],
    "--qk-pos-emb-head-dim": [flag("--qk-pos-emb-head-dim", "64", expect="refused", arch=MOE)],
    "--v-head-dim": [flag("--v-head-dim", "128", expect="refused", arch=MOE)],
    "--use-distributed-optimizer": [flag("--use-distributed-optimizer")],
    "--overlap-grad-reduce": [flag("--overlap-grad-reduce")],
    "--overlap-param-gather": [
        flag("--overlap-param-gather", base=("--use-distributed-optimizer", "--overlap-grad-reduce")),
        flag("--overlap-param-gather", expect="refused"),
    ],
    "--optimizer": [flag("--optimizer", "sgd")],
    # What it changes (the Adam Megatron steps) is no config field: tests/unit/test_train_stateless_adam.py.
    "--use-stateless-adam": [
        flag("--use-stateless-adam", base=("--optimizer", "sgd"), expect="refused"),
        flag("--use-stateless-adam", base=("--use-precision-aware-optimizer",), expect="refused"),
    ],
    "--weight-decay": [flag("--weight-decay", "0.1")],
    "--adam-beta1": [
        flag("--adam-beta1", "0.8"),
        flag("--adam-beta1", "0.8", base=("--optimizer", "sgd"), expect="refused"),
    ],
    "--adam-beta2": [flag("--adam-beta2", "0.98")],
    "--adam-eps": [flag("--adam-eps", "1e-6")],
    "--sgd-momentum": [
        flag("--sgd-momentum", "0.5", base=("--optimizer", "sgd")),
        flag("--sgd-momentum", "0.5", expect="refused"),
    ],
    "--clip-grad": [flag("--clip-grad", "0.5")],
    "--no-check-for-nan-in-loss-and-grad": [flag("--no-check-for-nan-in-loss-and-grad")],  # DDP's check
    "--optimizer-cpu-offload": [
        flag(
            "--optimizer-cpu-offload", base=("--use-distributed-optimizer", "--use-precision-aware-optimizer")
        ),
        flag("--optimizer-cpu-offload", base=(*CPU_PLAN, "--use-distributed-optimizer"), expect="refused"),
    ],
    "--optimizer-offload-fraction": [
        flag(
            "--optimizer-offload-fraction",
            "0.5",
            base=(
                "--use-distributed-optimizer",
                "--use-precision-aware-optimizer",
                "--optimizer-cpu-offload",
            ),
        ),
        flag("--optimizer-offload-fraction", "0.5", expect="refused"),
    ],
    "--overlap-cpu-optimizer-d2h-h2d": [
        flag(
            "--overlap-cpu-optimizer-d2h-h2d",
            base=(
                "--use-distributed-optimizer",
                "--use-precision-aware-optimizer",
                "--optimizer-cpu-offload",
            ),
        ),
        flag("--overlap-cpu-optimizer-d2h-h2d", expect="refused"),
    ],
    "--use-precision-aware-optimizer": [
        flag("--use-precision-aware-optimizer", base=("--use-distributed-optimizer",)),
        flag("--use-precision-aware-optimizer"),
        flag(
            "--use-precision-aware-optimizer",
            base=(*CPU_PLAN, "--use-distributed-optimizer"),
            expect="refused",
        ),
    ],
    "--train-iters": [flag("--train-iters", "5")],
    "--lr-decay-style": [flag("--lr-decay-style", "cosine")],
    "--lr-decay-iters": [flag("--lr-decay-iters", "5")],
    "--min-lr": [flag("--min-lr", "1e-7")],
    "--lr-warmup-iters": [flag("--lr-warmup-iters", "2")],
    "--lr-warmup-fraction": [flag("--lr-warmup-fraction", "0.1")],
    "--lr-warmup-init": [flag("--lr-warmup-init", "1e-7", base=("--lr-warmup-iters", "2"))],
    "--lr-wsd-decay-iters": [
        flag("--lr-wsd-decay-iters", "3", base=("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"))
    ],
    "--lr-wsd-decay-style": [
        flag("--lr-wsd-decay-style", "linear", base=("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"))
    ],
    "--bf16": [flag("--bf16")],
    "--fp16": [flag("--fp16")],
    "--loss-scale": [
        flag("--loss-scale", "128", base=("--fp16",)),
        flag("--loss-scale", "128", expect="refused"),
    ],
    "--initial-loss-scale": [flag("--initial-loss-scale", "1024", base=("--fp16",))],
    "--min-loss-scale": [flag("--min-loss-scale", "2", base=("--fp16",))],
    "--loss-scale-window": [flag("--loss-scale-window", "10", base=("--fp16",))],
    "--hysteresis": [flag("--hysteresis", "3", base=("--fp16",))],
    "--accumulate-allreduce-grads-in-fp32": [flag("--accumulate-allreduce-grads-in-fp32")],
    "--attention-dropout": [flag("--attention-dropout", "0.1")],
    "--hidden-dropout": [flag("--hidden-dropout", "0.1")],
    "--recompute-granularity": [flag("--recompute-granularity", "selective")],
    "--recompute-method": [flag("--recompute-method", "block", base=FULL)],
    "--recompute-num-layers": [flag("--recompute-num-layers", "2", base=FULL)],
    "--calculate-per-token-loss": [flag("--calculate-per-token-loss")],
    "--num-layers": [flag("--num-layers", "3", expect="refused")],
    "--hidden-size": [flag("--hidden-size", "128", expect="refused")],
    "--ffn-hidden-size": [flag("--ffn-hidden-size", "256", expect="refused")],
    "--num-attention-heads": [flag("--num-attention-heads", "8", expect="refused")],
    "--num-query-groups": [
        flag("--num-query-groups", "4", base=("--group-query-attention",), expect="refused")
    ],
    "--group-query-attention": [flag("--group-query-attention", expect="refused", arch=MHA)],
    "--kv-channels": [flag("--kv-channels", "32", expect="refused")],
    "--vocab-size": [flag("--vocab-size", "1000", expect="refused")],
    "--make-vocab-size-divisible-by": [flag("--make-vocab-size-divisible-by", "128")],
    "--max-position-embeddings": [flag("--max-position-embeddings", "4096", expect="refused")],
    "--seq-length": [flag("--seq-length", "512")],
    "--rotary-base": [flag("--rotary-base", "500000", expect="refused")],
    "--rotary-percent": [flag("--rotary-percent", "0.5", expect="refused")],
    # GLM-4's architecture flags: refused where the HF config disagrees; where it agrees they change
    # nothing (the HF config already builds the layer that way).
    "--rotary-interleaved": [
        flag("--rotary-interleaved", expect="refused"),
        flag("--rotary-interleaved", expect="ignored", arch=GLM4),
    ],
    "--post-self-attn-layernorm": [
        flag("--post-self-attn-layernorm", expect="refused"),
        flag("--post-self-attn-layernorm", expect="ignored", arch=GLM4),
    ],
    "--post-mlp-layernorm": [
        flag("--post-mlp-layernorm", expect="refused"),
        flag("--post-mlp-layernorm", expect="ignored", arch=GLM4),
    ],
    "--norm-epsilon": [flag("--norm-epsilon", "1e-5", expect="refused")],
    "--normalization": [flag("--normalization", "LayerNorm", expect="refused")],
    "--swiglu": [flag("--swiglu", expect="asserted")],
    "--disable-bias-linear": [flag("--disable-bias-linear", expect="asserted")],
    "--add-qkv-bias": [flag("--add-qkv-bias", expect="refused")],
    "--qk-layernorm": [flag("--qk-layernorm", expect="refused")],
    # Qwen3-Next's gated full attention (two spellings in slime's scripts) and 1p norms: properties
    # of the checkpoint, refused where the HF config has none.
    "--moe-shared-expert-gate": [
        flag("--moe-shared-expert-gate", expect="refused", arch=MOE),
        flag(
            "--moe-shared-expert-gate",
            expect="ignored",
            arch=dataclasses.replace(MOE, moe_shared_expert_gate=True),
        ),
    ],
    "--attention-output-gate": [
        flag("--attention-output-gate", expect="refused"),
        flag("--attention-output-gate", expect="ignored", arch=QWEN3_NEXT),
    ],
    "--use-gated-attention": [
        flag("--use-gated-attention", expect="refused"),
        flag("--use-gated-attention", expect="ignored", arch=QWEN3_NEXT),
    ],
    "--apply-layernorm-1p": [
        flag("--apply-layernorm-1p", expect="refused"),
        flag("--apply-layernorm-1p", expect="ignored", arch=QWEN3_NEXT),
    ],
    "--untie-embeddings-and-output-weights": [
        flag("--untie-embeddings-and-output-weights", expect="refused", arch=TIED)
    ],
    "--use-rotary-position-embeddings": [flag("--use-rotary-position-embeddings", expect="asserted")],
    "--position-embedding-type": [flag("--position-embedding-type", "learned_absolute", expect="refused")],
    # Megatron-LM's deprecated spelling: without rope it is refused; beside rope it states what holds
    # (no learned position embedding), as Megatron-LM accepts it (test_no_position_embedding).
    "--no-position-embedding": [flag("--no-position-embedding", expect="refused")],
    # slime's GLM-4 plugin spec is the layers tether builds (accepted, nothing to change); others are
    # refused by module (tests/unit/test_config_slime_flags.py).
    "--spec": [flag("--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec", expect="refused")],
    "--attention-backend": [
        flag("--attention-backend", "local"),
        flag("--attention-backend", "flash", base=CPU_PLAN, expect="refused"),
    ],
    "--use-flash-attn": [flag("--use-flash-attn"), flag("--use-flash-attn", base=CPU_PLAN, expect="refused")],
    "--attention-softmax-in-fp32": [flag("--attention-softmax-in-fp32")],
    "--no-rope-fusion": [flag("--no-rope-fusion")],
    "--no-masked-softmax-fusion": [flag("--no-masked-softmax-fusion")],
    "--no-gradient-accumulation-fusion": [flag("--no-gradient-accumulation-fusion")],
    "--deterministic-mode": [flag("--deterministic-mode")],
    "--distributed-timeout-minutes": [flag("--distributed-timeout-minutes", "45")],
    # Multi-token prediction: built from a checkpoint with MTP layers (MiMo), refused for one without.
    "--mtp-num-layers": [
        flag("--mtp-num-layers", "1", arch=MIMO),
        flag("--mtp-num-layers", "1", expect="refused"),
    ],
    "--mtp-loss-scaling-factor": [
        flag(
            "--mtp-loss-scaling-factor",
            "0.5",
            base=("--mtp-num-layers", "1", "--enable-mtp-training"),
            arch=MIMO,
        ),
        flag("--mtp-loss-scaling-factor", "0.5", base=("--mtp-num-layers", "1"), arch=MIMO, expect="refused"),
    ],
    # What it changes (the MTP loss in training steps, MTP weights trained) is no config field:
    # tests/unit/test_train_mtp.py and tests/integration/test_train_model.py (mimo_mtp) show it.
    "--enable-mtp-training": [flag("--enable-mtp-training", expect="refused")],
    # Builds nothing (slime picks its converter by it; tether converts by the HF config): checked
    # against the config's family, a name of another family refused.
    "--model-name": [flag("--model-name", "llama-3.1-8b", expect="checked")],
}
# Flags checked against the HF config only: a value the probe's config must refuse.
MISMATCHED = {"--model-name": ("model_name", "qwen3-4b")}


def produced(cfg: Config, arch: ModelArch) -> dict[str, Any]:
    """Everything a rank builds from the flags (GPU capabilities: no kernel hides a field)."""
    m, algo = cfg.megatron, cfg.algorithm
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    check_capabilities(m, GPU)
    resolved = megatron_args.resolve_arch(arch, m, tp_size=tp, pp_size=pp)
    return {
        "layout": (tp, pp, m.data_parallel_size(8)),
        "arch": resolved,
        "max_sequence_length": megatron_args.max_sequence_length(resolved, m),
        "transformer": megatron_args.transformer_config_kwargs(m, GPU, tp_size=tp),
        "ddp": megatron_args.ddp_config_kwargs(m),
        "optimizer": megatron_args.optimizer_config_kwargs(m, algo),
        "scheduler": megatron_args.scheduler_kwargs(m, algo),
        "init_distributed": megatron_args.init_distributed_kwargs(m, algo),
        "data_pad_size": megatron_args.data_pad_size(m, tp),  # stamped on the TransformerConfig
        # What build._prepare hands build_chunk beside the config: the gated delta rule's kernel.
        "gdn_backend": m.qwen_gdn_backend,
    }


def outcome(probe: Probe, name: str) -> tuple[Outcome, str]:
    def attempt(argv: list[str]) -> dict[str, Any]:
        return produced(parse(*argv), probe.arch)

    try:
        got = attempt(probe.argv)
    except ConfigError as exc:
        return ("refused" if exc.key == name else f"refused as {exc.key}"), str(exc)
    if probe.expect == "asserted":
        field = ALWAYS_TRUE[name]
        with pytest.raises(ConfigError) as err:
            check_architecture_flags(probe.arch, {field: False})
        return "asserted", str(err.value)
    base = attempt(probe.base)
    if probe.expect == "checked":
        field, wrong = MISMATCHED[name]
        check_architecture_flags(probe.arch, {field: probe.argv[-1]})
        with pytest.raises(ConfigError) as err:
            check_architecture_flags(probe.arch, {field: wrong})
        assert err.value.key == name, err.value
        return ("checked" if got == base else "consumed"), str(err.value)
    return ("consumed" if got != base else "ignored"), ""


def test_every_megatron_flag_reaches_megatron_or_is_refused() -> None:
    flags = [s.flag for s in flag_specs() if s.slice == "megatron"]
    assert sorted(PROBES) == sorted(flags), "add a probe for each new Megatron flag"
    wrong = {}
    for name in flags:
        for probe in PROBES[name]:
            got, why = outcome(probe, name)
            if got != probe.expect:
                wrong[" ".join(probe.argv)] = f"expected {probe.expect}, got {got} {why}"
    assert not wrong, wrong


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--use-distributed-post"], "--use-distributed-post=True:"),
        (["--cpu-devices", "2", "--bf16", "--attention-backend", "fused"], "--attention-backend='fused':"),
        (["--cpu-devices", "2", "--offload-train"], "--offload-train=True:"),
        (["--lambd", "0.9"], "--lambd=0.9:"),
    ],
)
def test_plan_and_run_refuse_alike(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tether.commands import plan as plan_command
    from tether.commands import run as run_command

    for prog, main in (("tether plan", plan_command.main_argv), ("tether run", run_command.main_argv)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)  # refused while parsing: nothing is planned or started
        assert exit_.value.code == 2
        assert capsys.readouterr().err.startswith(f"{prog}: {message}")


@pytest.mark.parametrize(
    ("config", "extra", "message"),
    [
        ({"model_type": "gpt2"}, [], "supported: llama"),
        (
            {"model_type": "glm4"},
            ["--rotary-percent", "1.0"],
            "--rotary-percent=1.0: the Hugging Face config (glm4) has 0.5",
        ),
        (
            {"model_type": "llama"},
            ["--rotary-interleaved"],
            "--rotary-interleaved=True: the Hugging Face config (llama) has False",
        ),
        (
            {"model_type": "qwen2"},
            ["--post-self-attn-layernorm"],
            "--post-self-attn-layernorm=True: the Hugging Face config (qwen2) has False",
        ),
        (
            {"model_type": "qwen3"},
            ["--post-mlp-layernorm"],
            "--post-mlp-layernorm=True: the Hugging Face config (qwen3) has False",
        ),
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
            },
            ["--tensor-model-parallel-size", "2"],
            "--sequence-parallel",
        ),
    ],
)
def test_plan_checks_the_hf_family_before_anything_starts(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], config: dict[str, Any], extra: list[str], message: str
) -> None:
    import json

    from tether.commands import plan as plan_command

    shape = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    (tmp_path / "config.json").write_text(json.dumps({**shape, **config}))
    with pytest.raises(SystemExit) as exit_:
        plan_command.main_argv(["--hf-checkpoint", str(tmp_path), *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tether plan: ") and message in err, err


def test_plan_accepts_moe_flags_that_match_the_hf_config(tmp_path: Any) -> None:
    # What slime's Qwen3-MoE scripts pass, shaped to a tiny qwen3_moe: planned on CPU at TP=2 with
    # sequence parallelism, nothing refused.
    import json

    from tether.commands import plan as plan_command

    config = {
        "model_type": "qwen3_moe",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [
        "--hf-checkpoint", str(tmp_path), "--cpu-devices", "4", "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-layer-freq", "[1]*2", "--moe-router-score-function", "softmax",
        "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0",
        "--moe-router-load-balancing-type", "none", "--qk-layernorm", "--kv-channels", "16",
        "--group-query-attention", "--num-query-groups", "2",
    ]  # fmt: skip
    assert plan_command.main_argv(argv) == 0


# slime's scripts/models/glm4-9B.sh (every flag but --spec, which names slime's layer-spec plugin; tether
# builds the layer through its bridge) with scripts/run-glm4-9B.sh's TP=2 + sequence parallelism, the
# sizes scaled to a tiny glm4 config.
SLIME_GLM4 = """--swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --use-rotary-position-embeddings --disable-bias-linear
--add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5 --rotary-base 10000 --vocab-size 320
--post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved --rotary-percent 0.5 --no-rope-fusion
--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 --sequence-parallel"""


def test_plan_accepts_slime_glm4_flags_that_match_the_hf_config(tmp_path: Any) -> None:
    import json

    from tether.commands import plan as plan_command
    from tether.train.model.hf_config import load_arch

    config = {
        "model_type": "glm4",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cpu = ["--cpu-devices", "4", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]
    assert plan_command.main_argv(["--hf-checkpoint", str(tmp_path), *cpu, *SLIME_GLM4.split()]) == 0
    m = parse(*SLIME_GLM4.split()).megatron
    assert (m.post_self_attn_layernorm, m.post_mlp_layernorm, m.rotary_interleaved) == (True, True, True)
    arch = megatron_args.resolve_arch(load_arch(tmp_path), m, tp_size=2, pp_size=1)
    assert arch.post_sublayer_norms and arch.rotary_interleaved and arch.rotary_percent == 0.5


SLIME_QWEN3_MOE = """--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 4
--num-query-groups 2 --kv-channels 16 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu
--untie-embeddings-and-output-weights --vocab-size 320 --rotary-base 1000000 --moe-ffn-hidden-size 32
--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 2
--moe-layer-freq [1,1] --num-experts 4 --moe-grouped-gemm --moe-token-drop-policy probs
--moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0"""
SLIME_DEEPSEEK_V3 = """--disable-bias-linear --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
--num-attention-heads 4 --kv-channels 16 --normalization RMSNorm --position-embedding-type rope
--norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --vocab-size 320
--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
--v-head-dim 16 --qk-layernorm --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0
--mscale-all-dim 1.0 --attention-softmax-in-fp32 --no-rope-fusion --num-experts 8 --moe-layer-freq [0,1]
--moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-shared-expert-intermediate-size 32
--moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0
--moe-router-bias-update-rate 0 --moe-router-group-topk 1 --moe-router-num-groups 2 --moe-grouped-gemm
--moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-permute-fusion"""
# scripts/models/glm4.7-30B-A3B.sh (with run-glm4.7-30B-A3B.sh's MTP_ARGS): --add-qkv-bias beside
# --multi-latent-attention, which Megatron's MLA never reads.
SLIME_GLM4_7_FLASH = """--moe-layer-freq [0]*1+[1]*1 --num-experts 8 --moe-shared-expert-intermediate-size 32
--moe-router-topk 2 --moe-grouped-gemm --moe-permute-fusion --moe-ffn-hidden-size 32
--moe-router-score-function sigmoid --moe-router-pre-softmax --moe-router-enable-expert-bias
--moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk-scaling-factor 1.8 --moe-aux-loss-coeff 0 --moe-router-dtype fp32
--make-vocab-size-divisible-by 64 --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
--num-attention-heads 4 --disable-bias-linear --add-qkv-bias --swiglu --untie-embeddings-and-output-weights
--position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm
--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --v-head-dim 32
--kv-channels 16 --qk-pos-emb-head-dim 8 --vocab-size 320 --rotary-base 1000000 --no-rope-fusion
--mtp-num-layers 1 --enable-mtp-training --mtp-loss-scaling-factor 0.2"""
# scripts/models/kimi-k2.sh.
SLIME_KIMI_K2 = """--disable-bias-linear --num-layers 2 --hidden-size 64 --ffn-hidden-size 128
--num-attention-heads 4 --kv-channels 16 --normalization RMSNorm --position-embedding-type rope
--norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --vocab-size 320
--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
--v-head-dim 16 --qk-layernorm --rotary-scaling-factor 32.0 --rotary-base 50000 --mscale 1.0
--mscale-all-dim 1.0 --attention-softmax-in-fp32 --no-rope-fusion --num-experts 8 --moe-layer-freq [0,1]
--moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-shared-expert-intermediate-size 32
--moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0
--moe-router-bias-update-rate 0 --moe-router-group-topk 1 --moe-router-num-groups 1 --moe-grouped-gemm
--moe-router-topk-scaling-factor 2.827 --moe-router-dtype fp32 --moe-permute-fusion"""
TINY = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    ("config", "model_args"),
    [
        (
            {"model_type": "qwen3_moe", "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            SLIME_QWEN3_MOE,
        ),
        (
            {"model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
             "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1}},
            SLIME_DEEPSEEK_V3,
        ),
        (
            {"model_type": "glm4_moe_lite", "num_key_value_heads": 4, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 1,
             "topk_group": 1, "routed_scaling_factor": 1.8, "norm_topk_prob": True, "q_lora_rank": 32,
             "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 32,
             "mlp_layer_types": ["dense", "sparse"], "first_k_dense_replace": 1,
             "num_nextn_predict_layers": 1, "rope_interleave": True, "rms_norm_eps": 1e-5,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
            SLIME_GLM4_7_FLASH,
        ),
        (
            {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_key_value_heads": 4,
             "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 2.827, "norm_topk_prob": True, "q_lora_rank": 32, "kv_lora_rank": 16,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_nextn_predict_layers": 0,
             "rope_theta": 50000.0,
             "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
            SLIME_KIMI_K2,
        ),
    ],
    ids=["qwen3-30B-A3B", "deepseek-v3", "glm4.7-30B-A3B", "kimi-k2"],
)  # fmt: skip
def test_slime_moe_model_args_agree_with_their_hf_config(
    tmp_path: Any, config: dict[str, Any], model_args: str
) -> None:
    # slime's scripts/models/{qwen3-30B-A3B,deepseek-v3,glm4.7-30B-A3B,kimi-k2}.sh, every flag kept,
    # the sizes scaled to a tiny HF config of the same family: parsed (a GPU plan), then checked
    # against the HF config.
    import json

    from tether.train.model.hf_config import load_arch

    (tmp_path / "config.json").write_text(json.dumps({**TINY, **config}))
    m = parse(*model_args.split()).megatron
    arch = megatron_args.resolve_arch(load_arch(tmp_path), m, tp_size=1, pp_size=1)
    kwargs = megatron_args.transformer_config_kwargs(m, GPU, tp_size=1)
    assert kwargs["moe_grouped_gemm"] and kwargs["moe_permute_fusion"]
    dispatcher = "alltoall" if "alltoall" in model_args else "allgather"  # Megatron's default
    assert kwargs["moe_token_dispatcher_type"] == dispatcher and kwargs["moe_router_dtype"] == "fp32"
    assert arch.is_moe and arch.num_experts == m.num_experts
    assert arch.model_type == config["model_type"]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"use_routing_bias": False}, "use_routing_bias"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type"),
        ({"attn_type_list": [0, 1]}, "attn_type_list"),
    ],
)
def test_a_minimax_m2_config_that_is_not_what_transformers_builds_is_refused(
    tmp_path: Path, change: dict[str, object], key: str
) -> None:
    from tether.train.model.hf_config import load_arch

    base = {
        "model_type": "minimax_m2",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
    }
    (tmp_path / "config.json").write_text(json.dumps(base))
    arch = load_arch(tmp_path)
    assert (arch.qk_norm_full, arch.rotary_percent, arch.moe_router_score_function) == (True, 0.5, "sigmoid")
    assert arch.moe_router_enable_expert_bias and arch.qk_layernorm
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(ConfigError) as err:
        load_arch(tmp_path)
    assert err.value.key.endswith(f"config.json:{key}")

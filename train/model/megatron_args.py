"""The Megatron configs a trainer rank builds from the parsed flags, as pure functions.

Each builder maps the `MegatronConfig` slice (and the `--lr` of the algorithm slice) onto the
fields of one Megatron object, with Megatron's meaning for each flag:

- `transformer_config_kwargs` → `TransformerConfig` (precision, dropout, recompute, sequence
  parallelism, uneven pipeline stages, attention backend, fusions, per-token loss);
- `ddp_config_kwargs` → `DistributedDataParallelConfig` (fp32 gradient reduction, overlap,
  distributed optimizer);
- `optimizer_config_kwargs` → `OptimizerConfig` (adam/sgd, loss scaling, CPU offload, precision-aware
  optimizer, parameter all-gather overlap);
- `scheduler_kwargs` → `OptimizerParamScheduler` (warm-up, decay style and horizon, WSD).

They return keyword dicts, so tests can check every field without CUDA or an initialised
torch.distributed (some GPU-only fields cannot be constructed on CPU); `build_*` turn them into
the Megatron objects. `tether.train.model.build` builds the actor and the reference with them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model.capabilities import Capabilities, uses_transformer_engine_spec
from tether.train.model.hf_config import ModelArch, check_architecture_flags, check_parallel
from tether.train.model.megatron_cpu import quiet_megatron_imports


def params_dtype(megatron: MegatronConfig) -> torch.dtype:
    """The model's parameter dtype: --bf16, --fp16, else float32 (all three run on CPU too)."""
    if megatron.bf16:
        return torch.bfloat16
    if megatron.fp16:
        return torch.float16
    return torch.float32


def _check_layout(arch: ModelArch, megatron: MegatronConfig, tp_size: int, pp_size: int) -> None:
    """The parallel layout fits the model's shape (see `check_parallel`)."""
    check_parallel(
        arch,
        tp_size,
        pp_size,
        megatron.decoder_first_pipeline_num_layers,
        megatron.decoder_last_pipeline_num_layers,
        ep_size=megatron.expert_model_parallel_size,
        etp_size=megatron.expert_tensor_parallel_size,
        sequence_parallel=megatron.sequence_parallel,
        cp_size=megatron.context_parallel_size,
        allgather_cp=megatron.allgather_cp,
    )


def resolve_arch(arch: ModelArch, megatron: MegatronConfig, *, tp_size: int, pp_size: int) -> ModelArch:
    """The HF architecture as this run builds it: architecture flags checked against it, the layout
    checked against its shape, the vocabulary padding of --make-vocab-size-divisible-by applied."""
    check_architecture_flags(arch, megatron.architecture())
    _check_layout(arch, megatron, tp_size, pp_size)
    return dataclasses.replace(arch, vocab_multiple=megatron.make_vocab_size_divisible_by or 1)


def max_sequence_length(arch: ModelArch, megatron: MegatronConfig) -> int:
    """The longest sample the trainer accepts: --seq-length, else the model's max positions."""
    return megatron.seq_length or arch.max_position_embeddings


def transformer_config_kwargs(
    megatron: MegatronConfig, caps: Capabilities, *, tp_size: int
) -> dict[str, Any]:
    """TransformerConfig fields (beyond the HF shape) for these flags; `transformer_config` applies them."""
    with quiet_megatron_imports():
        from megatron.core.transformer.enums import AttnBackend

    te_spec = uses_transformer_engine_spec(megatron, caps)
    kwargs: dict[str, Any] = {
        "params_dtype": params_dtype(megatron),
        "hidden_dropout": megatron.hidden_dropout,
        "attention_dropout": megatron.attention_dropout,
        # Megatron-LM turns sequence parallelism off at TP = 1 (nothing to split over).
        "sequence_parallel": megatron.sequence_parallel and tp_size > 1,
        "recompute_granularity": megatron.recompute_granularity,
        "recompute_method": megatron.recompute_method,
        "recompute_num_layers": megatron.recompute_num_layers,
        "num_layers_in_first_pipeline_stage": megatron.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": megatron.decoder_last_pipeline_num_layers,
        "attention_softmax_in_fp32": megatron.attention_softmax_in_fp32,
        "calculate_per_token_loss": megatron.calculate_per_token_loss,
        "deterministic_mode": megatron.deterministic_mode,
        # Megatron's fusions default on; each --no-*-fusion turns one off. A fusion whose kernel
        # this rank lacks stays off (Megatron would fail to build or run it). For MLA the model
        # decides too (`transformer_config`, `rope_fusion_fits`).
        "masked_softmax_fusion": not megatron.no_masked_softmax_fusion
        and caps.cuda
        and (te_spec or caps.fused_softmax_kernels),
        "apply_rope_fusion": not megatron.no_rope_fusion and caps.transformer_engine,
        # Apex's kernel under either spec: the output layer is Megatron's ColumnParallelLinear even
        # with TE's layers, and it raises at construction without fused_weight_gradient_mlp_cuda.
        "gradient_accumulation_fusion": not megatron.no_gradient_accumulation_fusion
        and caps.cuda
        and caps.fused_wgrad_kernels,
    }
    backend = megatron.resolved_attention_backend
    if backend is not None:
        kwargs["attention_backend"] = AttnBackend[backend]
    kwargs.update(moe_config_kwargs(megatron))
    kwargs.update(mtp_config_kwargs(megatron))
    return kwargs


def rope_fusion_fits(arch: ModelArch) -> bool:
    """Whether Megatron has a fused RoPE kernel for this model's attention.

    MLA's only one is for YaRN (megatron/core/fusions/fused_mla_yarn_rope_apply.py), and
    MLATransformerConfig refuses the fusion with plain RoPE. The fusion is Megatron's default, not
    something a flag asks for (there is only --no-rope-fusion), so such a model runs unfused, as for
    any fusion whose kernel is missing.
    """
    return not arch.multi_latent_attention or arch.yarn is not None


def mtp_config_kwargs(megatron: MegatronConfig) -> dict[str, Any]:
    """Multi-token prediction: --mtp-num-layers MTP layers on the last stage (0 or unset: none, as
    in slime), their loss weight --mtp-loss-scaling-factor (tether.train.model.mtp)."""
    return {
        "mtp_num_layers": megatron.mtp_num_layers or None,
        "mtp_loss_scaling_factor": megatron.mtp_loss_scaling_factor,
    }


def moe_config_kwargs(megatron: MegatronConfig) -> dict[str, Any]:
    """The MoE knobs (not properties of the checkpoint: those come from the HF config) and the expert
    parallel sizes, with Megatron's defaults for the flags not set. Dense models drop them."""
    return {
        "expert_model_parallel_size": megatron.expert_model_parallel_size,
        "expert_tensor_parallel_size": megatron.expert_tensor_parallel_size,
        "moe_router_load_balancing_type": megatron.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": megatron.moe_aux_loss_coeff,
        "moe_grouped_gemm": megatron.moe_grouped_gemm,
        "moe_token_dispatcher_type": megatron.moe_token_dispatcher_type,
        "moe_enable_deepep": megatron.moe_enable_deepep,
        "moe_router_dtype": megatron.moe_router_dtype,
        "moe_router_bias_update_rate": megatron.moe_router_bias_update_rate,
        "moe_permute_fusion": megatron.moe_permute_fusion,
        "moe_token_drop_policy": megatron.moe_token_drop_policy,
    }


def transformer_config(
    arch: ModelArch,
    megatron: MegatronConfig,
    caps: Capabilities,
    *,
    tp_size: int,
    pp_size: int,
    base: dict[str, Any] | None = None,
    mtp: bool = True,
) -> Any:
    """The TransformerConfig of one model chunk (actor and reference share it).

    `base`: mbridge's HF → Megatron kwargs for the checkpoint (`tether.train.model.bridge.open_bridge`);
    the HF facts of `arch` and the flags' kwargs are applied over it. `mtp`: with the MTP layers of
    --mtp-num-layers (not for the PPO critic, whose head predicts values).
    """
    from tether.train.model import bridge

    _check_layout(arch, megatron, tp_size, pp_size)
    overrides = transformer_config_kwargs(megatron, caps, tp_size=tp_size)
    overrides["apply_rope_fusion"] = overrides["apply_rope_fusion"] and rope_fusion_fits(arch)
    if not mtp:
        overrides["mtp_num_layers"] = None
    overrides.update(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=megatron.context_parallel_size,
    )
    config = bridge.build_config(arch, bridge.config_kwargs(base or {}, arch, overrides))
    # Not a Megatron field: how this model's micro-batches are padded (`micro_batch_multiple`),
    # carried with the config that every micro-batch of the model is built against.
    setattr(config, _DATA_PAD_SIZE, data_pad_size(megatron, tp_size))
    return config


def ddp_config_kwargs(megatron: MegatronConfig) -> dict[str, Any]:
    """`DistributedDataParallelConfig` fields: Megatron-LM reduces gradients in fp32 when asked, and
    always with --bf16."""
    return {
        "grad_reduce_in_fp32": megatron.accumulate_allreduce_grads_in_fp32 or megatron.bf16,
        "overlap_grad_reduce": megatron.overlap_grad_reduce,
        "overlap_param_gather": megatron.overlap_param_gather,
        "use_distributed_optimizer": megatron.distributed_optimizer,
        "bucket_size": None,
        # Megatron-LM's args.check_for_nan_in_loss_and_grad: on unless --no-check-..., and off
        # under fp16's dynamic loss scaling, where an inf/NaN gradient tells the scaler to skip.
        "check_for_nan_in_grad": not megatron.no_check_for_nan_in_loss_and_grad
        and not (megatron.fp16 and megatron.loss_scale is None),
    }


def init_distributed_kwargs(megatron: MegatronConfig, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """What every trainer rank passes to `tether.train.parallel.topology.init_distributed`."""
    return {
        "tensor_parallel": megatron.tensor_model_parallel_size,
        "pipeline_parallel": megatron.pipeline_model_parallel_size,
        "seed": algorithm.seed,
        "timeout_minutes": megatron.distributed_timeout_minutes,
        "deterministic": megatron.deterministic_mode,
        "expert_parallel": megatron.expert_model_parallel_size,
        "expert_tensor_parallel": megatron.expert_tensor_parallel_size,
        "context_parallel": megatron.context_parallel_size,
        "contiguous_context": megatron.allgather_cp,
        "experimental": megatron.enable_experimental,
    }


def ddp_config(megatron: MegatronConfig) -> Any:
    with quiet_megatron_imports():
        from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**ddp_config_kwargs(megatron))


def optimizer_config_kwargs(megatron: MegatronConfig, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """`OptimizerConfig` fields (Megatron's defaults for the flags that were not set)."""
    return {
        "optimizer": megatron.optimizer,
        "lr": algorithm.lr,
        "min_lr": megatron.min_lr,
        "weight_decay": megatron.weight_decay,
        "adam_beta1": megatron.adam_beta1,
        "adam_beta2": megatron.adam_beta2,
        "adam_eps": megatron.adam_eps,
        "sgd_momentum": megatron.sgd_momentum,
        "clip_grad": megatron.clip_grad,
        "bf16": megatron.bf16,
        "fp16": megatron.fp16,
        "params_dtype": params_dtype(megatron),
        "loss_scale": megatron.loss_scale,
        "initial_loss_scale": megatron.initial_loss_scale,
        "min_loss_scale": megatron.min_loss_scale,
        "loss_scale_window": megatron.loss_scale_window,
        "hysteresis": megatron.hysteresis,
        "use_distributed_optimizer": megatron.distributed_optimizer,
        "overlap_param_gather": megatron.overlap_param_gather,
        "optimizer_cpu_offload": megatron.optimizer_cpu_offload,
        "optimizer_offload_fraction": megatron.optimizer_offload_fraction,
        "overlap_cpu_optimizer_d2h_h2d": megatron.overlap_cpu_optimizer_d2h_h2d,
        "use_precision_aware_optimizer": megatron.use_precision_aware_optimizer,
    }


def optimizer_config(megatron: MegatronConfig, algorithm: AlgorithmConfig) -> Any:
    with quiet_megatron_imports():
        from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**optimizer_config_kwargs(megatron, algorithm))


def scheduler_kwargs(megatron: MegatronConfig, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """`OptimizerParamScheduler` arguments, counted in optimizer steps (tether steps it once per step).

    Megatron's meaning: the LR warms up from --lr-warmup-init over --lr-warmup-iters (or
    --lr-warmup-fraction of the decay horizon), then decays to --min-lr over --lr-decay-iters,
    which defaults to --train-iters (tether derives that from --num-rollout).
    """
    horizon = megatron.lr_decay_horizon
    if horizon is None and (megatron.lr_decay_style != "constant" or megatron.lr_warmup_fraction):
        flag, value = (
            ("--lr-warmup-fraction", megatron.lr_warmup_fraction)
            if megatron.lr_decay_style == "constant"
            else ("--lr-decay-style", megatron.lr_decay_style)
        )
        raise ConfigError(
            flag,
            value,
            "needs the schedule's horizon: --lr-decay-iters, --train-iters, or --num-rollout "
            "(from which --train-iters is derived)",
        )
    if megatron.lr_warmup_fraction is not None:
        assert horizon is not None
        warmup: float = megatron.lr_warmup_fraction * horizon
    else:
        warmup = megatron.lr_warmup_iters
    if megatron.lr_decay_style == "constant":
        # A constant schedule never reads the decay horizon; Megatron only asks it to exceed the warm-up.
        decay = max(horizon or 1, int(warmup) + 1)
    else:
        assert horizon is not None
        decay = horizon
    out: dict[str, Any] = {
        "init_lr": megatron.lr_warmup_init,
        "max_lr": algorithm.lr,
        "min_lr": megatron.min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": megatron.lr_decay_style,
        "start_wd": megatron.weight_decay,
        "end_wd": megatron.weight_decay,
        "wd_incr_steps": megatron.train_iters or decay,
        "wd_incr_style": "constant",
    }
    if megatron.lr_decay_style == "WSD":
        out["wsd_decay_steps"] = megatron.lr_wsd_decay_iters
        out["lr_wsd_decay_style"] = megatron.lr_wsd_decay_style
    return out


def build_scheduler(optimizer: Any, megatron: MegatronConfig, algorithm: AlgorithmConfig) -> Any:
    """Megatron's LR/WD scheduler over `optimizer` (anything with `param_groups`)."""
    with quiet_megatron_imports():
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(megatron, algorithm))


_DATA_PAD_SIZE = "_tether_data_pad_size"


def data_pad_size(megatron: MegatronConfig, tp_size: int) -> int:
    """slime's pad_size: TP x --data-pad-size-multiplier (1 when unset). A micro-batch's positions (each CP rank's
    share of them) are padded to a multiple of it (`micro_batch_multiple`)."""
    multiplier = megatron.data_pad_size_multiplier
    return 1 if multiplier is None else tp_size * multiplier


def micro_batch_multiple(config: Any) -> int:
    """What a micro-batch's sequence length is padded to a multiple of: `sequence_multiple`, and CP x
    `data_pad_size` so that each CP rank's share is a multiple of the pad size, as slime pads each
    rank's packed tokens (1 for a config `transformer_config` did not build)."""
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    return math.lcm(sequence_multiple(config), cp * int(getattr(config, _DATA_PAD_SIZE, 1)))


def sequence_multiple(config: Any) -> int:
    """Micro-batch sequence lengths must be a multiple of this: 2 x CP under context parallelism
    (tether.train.parallel.context's chunks), times TP under sequence parallelism (each CP rank's
    share is split over the TP ranks between the layers)."""
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    multiple = 2 * cp if cp > 1 else 1
    return multiple * (int(config.tensor_model_parallel_size) if config.sequence_parallel else 1)

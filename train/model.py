"""Build the actor (trainable, DDP-wrapped, with optimizer) and the frozen reference model.

Models are Megatron GPTModel chunks built from a Hugging Face checkpoint's config and weights
with the local (non-TransformerEngine) layer spec on CPU, TE's spec on GPU when installed.
One chunk per rank (no virtual pipeline stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.train import hf_convert
from tether.train.hf_config import ModelArch, load_arch, transformer_config
from tether.train.megatron_cpu import quiet_megatron_imports
from tether.train.parallel import Topology


@dataclass(frozen=True)
class ModelOptions:
    """What the builder needs beyond the HF checkpoint (mapped from the Megatron/algorithm slices)."""

    hf_checkpoint: str
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    bf16: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    max_sequence_length: int | None = None
    transformer_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 and torch.cuda.is_available() else torch.float32


@dataclass
class Actor:
    """The trainable model: DDP-wrapped chunks, Megatron optimizer and LR scheduler."""

    arch: ModelArch
    config: Any
    chunks: list[Any]
    optimizer: Any
    scheduler: Any


@dataclass
class Reference:
    """A frozen copy of the model for KL: no grads, no optimizer."""

    arch: ModelArch
    config: Any
    chunks: list[Any]


def _layer_spec(arch: ModelArch) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if torch.cuda.is_available():
        try:
            import transformer_engine  # noqa: F401

            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
        except ImportError:
            pass
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")


def build_chunk(arch: ModelArch, config: Any, topo: Topology, max_sequence_length: int | None = None) -> Any:
    """This PP stage's GPTModel (embedding on the first stage, norm + output on the last)."""
    with quiet_megatron_imports():
        from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(arch),
        vocab_size=arch.padded_vocab_size(topo.tp_size),
        max_sequence_length=max_sequence_length or arch.max_position_embeddings,
        pre_process=topo.is_first_stage,
        post_process=topo.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _config(arch: ModelArch, opts: ModelOptions, topo: Topology) -> Any:
    return transformer_config(
        arch,
        tp_size=topo.tp_size,
        pp_size=topo.pp_size,
        params_dtype=opts.params_dtype,
        hidden_dropout=opts.hidden_dropout,
        attention_dropout=opts.attention_dropout,
        **opts.transformer_overrides,
    )


def load_hf_weights(chunks: list[Any], arch: ModelArch, hf_dir: str | Path, topo: Topology) -> None:
    """Fill every parameter of `chunks` from the HF checkpoint, sharded for this rank."""
    weights = hf_convert.HFWeights(hf_dir)
    for chunk in chunks:
        hf_convert.load_hf_into(chunk, arch, weights, topo.tp_rank, topo.tp_size)


def build_actor(opts: ModelOptions, topo: Topology, *, load_weights: bool = True) -> Actor:
    """Actor chunks wrapped in Megatron DDP, with optimizer and LR scheduler.

    `load_weights=False` skips reading HF weights (a checkpoint load follows).
    """
    with quiet_megatron_imports():
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    arch = load_arch(opts.hf_checkpoint)
    config = _config(arch, opts, topo)
    chunk = build_chunk(arch, config, topo, opts.max_sequence_length)
    if load_weights:
        load_hf_weights([chunk], arch, opts.hf_checkpoint, topo)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=opts.use_distributed_optimizer,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
    # DDP copies params into its contiguous buffers; broadcast keeps DP replicas identical.
    ddp.broadcast_params()
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=opts.lr,
        min_lr=opts.min_lr,
        weight_decay=opts.weight_decay,
        adam_beta1=opts.adam_beta1,
        adam_beta2=opts.adam_beta2,
        adam_eps=opts.adam_eps,
        clip_grad=opts.clip_grad,
        bf16=opts.params_dtype == torch.bfloat16,
        params_dtype=opts.params_dtype,
        use_distributed_optimizer=opts.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # Megatron's scheduler counts in samples/steps; tether steps it once per optimizer step.
    decay = opts.lr_decay_iters or 10**9
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opts.lr_warmup_iters else opts.lr,
        max_lr=opts.lr,
        min_lr=opts.min_lr,
        lr_warmup_steps=opts.lr_warmup_iters,
        lr_decay_steps=max(decay, opts.lr_warmup_iters + 1),
        lr_decay_style=opts.lr_decay_style,
        start_wd=opts.weight_decay,
        end_wd=opts.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
    return Actor(arch=arch, config=config, chunks=[ddp], optimizer=optimizer, scheduler=scheduler)


def build_reference(opts: ModelOptions, topo: Topology, *, load_weights: bool = True) -> Reference:
    """A frozen model with the actor's shape, for KL; weights from HF unless a checkpoint follows."""
    arch = load_arch(opts.hf_checkpoint)
    config = _config(arch, opts, topo)
    chunk = build_chunk(arch, config, topo, opts.max_sequence_length)
    if load_weights:
        load_hf_weights([chunk], arch, opts.hf_checkpoint, topo)
    for p in chunk.parameters():
        p.requires_grad_(False)
    chunk.eval()
    return Reference(arch=arch, config=config, chunks=[chunk])


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP/Float16 wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

"""Build the actor (trainable, DDP-wrapped, with optimizer) and the frozen reference model.

Models are Megatron GPTModel chunks built from a Hugging Face checkpoint's config and weights
through mbridge (`tether.train.model.bridge`: dense, MoE and MLA families), with TransformerEngine's
layer spec when the rank has TE (and --attention-backend is not local), Megatron's local spec
otherwise (always on CPU). One chunk per rank (no virtual pipeline stages). Every Megatron flag
reaches its config through the pure builders of `tether.train.model.megatron_args`; flags this rank
cannot run are refused first (`tether.train.model.capabilities`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import bridge, megatron_args, mtp, stateless_adam
from tether.train.model.capabilities import Capabilities, check_capabilities, uses_transformer_engine_spec
from tether.train.model.custom_provider import provide_chunk
from tether.train.model.families.dsa import (
    SparseIndexer,
    check_stage_starts,
    freeze_indexers,
    with_sparse_attention,
)
from tether.train.model.families.qwen3_next import mark_gated_delta_net_params, select_gdn_backend
from tether.train.model.hf_config import ModelArch, load_arch
from tether.train.model.hf_convert import HFWeights
from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.model.value_head import attach_value_head
from tether.train.parallel.topology import Topology
from tether.train.state.param_freeze import apply_freeze


@dataclass(frozen=True)
class ModelOptions:
    """What the builder needs: the HF checkpoint and the two trainer config slices."""

    hf_checkpoint: str
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    capabilities: Capabilities | None = None
    """What this rank can run; detected when None."""

    def resolved_capabilities(self) -> Capabilities:
        return self.capabilities if self.capabilities is not None else Capabilities.detect()


@dataclass
class Actor:
    """The trainable model: DDP-wrapped chunks, Megatron optimizer and LR scheduler."""

    arch: ModelArch
    config: Any
    chunks: list[Any]
    optimizer: Any
    scheduler: Any
    weights: bridge.WeightBridge
    """HF names and layouts of the chunks' weights (load and export)."""


@dataclass
class Reference:
    """A frozen copy of the model for KL: no grads, no optimizer."""

    arch: ModelArch
    config: Any
    chunks: list[Any]
    weights: bridge.WeightBridge


def build_chunk(
    arch: ModelArch,
    config: Any,
    topo: Topology,
    max_sequence_length: int | None = None,
    *,
    transformer_engine: bool | None = None,
    train_mtp: bool = False,
    gdn_backend: str = "fla",
) -> Any:
    """This PP stage's GPTModel (embedding on the first stage, norm + output on the last).

    `transformer_engine`: build with TE's layers (default: when CUDA and TE are available). The
    block spec follows `config` (dense or MoE per layer, MLA, qk-norm; `bridge.layer_spec`) and
    `arch` (GLM-4's norms of attention's and the MLP's outputs). `gdn_backend`: --qwen-gdn-backend.
    """
    with quiet_megatron_imports():
        from megatron.core.models.gpt import GPTModel

    if transformer_engine is None:
        transformer_engine = Capabilities.detect().transformer_engine
    if arch.linear_attention is not None:
        select_gdn_backend(gdn_backend)
    spec = bridge.layer_spec(
        config,
        transformer_engine,
        topo.pp_rank,
        post_sublayer_norms=arch.post_sublayer_norms,
        full_qk_norms=arch.qk_norm_full,
    )
    indexer = SparseIndexer.of(arch)
    if indexer is not None:
        spec = with_sparse_attention(
            spec, indexer, context_parallel=int(config.context_parallel_size or 1) > 1
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        # --mtp-num-layers: Megatron's MTP block (last stage only), its layers shaped like the
        # stage's last decoder layer; tether.train.model.mtp runs it.
        mtp_block_spec=bridge.mtp_block_spec(config, spec, transformer_engine, topo.pp_rank),
        vocab_size=arch.padded_vocab_size(topo.tp_size),
        max_sequence_length=max_sequence_length or arch.max_position_embeddings,
        pre_process=topo.is_first_stage,
        post_process=topo.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rotary_percent=arch.rotary_percent,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    mark_tensor_parallel_params(model)
    if arch.linear_attention is not None:
        mark_gated_delta_net_params(model)
    if indexer is not None:
        if len(model.decoder.layers):
            check_stage_starts(indexer, int(model.decoder.layers[0].layer_number))
        model.tether_sparse_attention = True  # step.forward passes it an explicit causal mask
    mtp.install(model, train=train_mtp)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def provided_chunk(path: str, config: Any, topo: Topology, *, train_mtp: bool = False) -> Any:
    """This PP stage's chunk from --custom-model-provider-path (`tether.train.model.custom_provider`),
    finished as `build_chunk` finishes its own: TP attributes, MTP post-processing, device."""
    model = provide_chunk(path, config, pre_process=topo.is_first_stage, post_process=topo.is_last_stage)
    mark_tensor_parallel_params(model)
    mtp.install(model, train=train_mtp)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def mark_tensor_parallel_params(model: Any) -> int:
    """Give the weights of Megatron's own tensor-parallel layers their TP attributes
    (`tensor_model_parallel`, `partition_dim`, `partition_stride`) where the layer left them unset;
    returns how many weights were marked.

    Why: megatron-core 0.16 sets these attributes only inside its weight initializers
    (tensor_parallel/layers.py `_initialize_affine_weight_cpu/_gpu`), which ColumnParallelLinear,
    RowParallelLinear and VocabParallelEmbedding call only when `config.perform_initialization` is
    on. tether builds with it off (HF weights overwrite every parameter), so those sharded weights
    looked replicated: the optimizer's grad-norm filter (`param_is_not_tensor_parallel_duplicate`)
    kept them on TP rank 0 only and dropped the other ranks' shards from the model-parallel sum.
    The reported grad norm was too low at TP > 1 and --clip-grad clipped too little. (The same
    holds on GPU for the embedding and output layer, which are Megatron layers under TE's spec too;
    TE's own linear layers set the attributes themselves and are left as they are.) Megatron-LM
    initializes by default, so it rarely meets this; Megatron-Bridge (PR #992) worked around the
    same gap by keeping initialization on, which here would build every full weight on every rank.
    """
    with quiet_megatron_imports():
        from megatron.core.tensor_parallel.layers import (
            ColumnParallelLinear,
            RowParallelLinear,
            VocabParallelEmbedding,
            set_tensor_model_parallel_attributes,
        )
        from megatron.core.transformer.mlp import MLP

    # MLP builds a gated linear_fc1 with stride 2 ([gate, up] interleaved per rank) and does not keep
    # the stride on the layer; mirror its rule.
    strides: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, MLP) and module.config.gated_linear_unit and not module.config.use_kitchen:
            strides[id(module.linear_fc1)] = 2
    marked = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        # Tied output layers hold no weight of their own (skip_weight_param_allocation).
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, True, dim, strides.get(id(module), 1))
        marked += 1
    return marked


def _prepare(
    opts: ModelOptions, topo: Topology, *, mtp_block: bool = True, train_mtp: bool = False
) -> tuple[ModelArch, Any, Any, bridge.WeightBridge]:
    """Refuse what this rank cannot run, then the resolved architecture, its TransformerConfig, the
    first chunk (weights not loaded) and the bridge that loads and exports its weights.
    `mtp_block`: with --mtp-num-layers' MTP layers; `train_mtp`: their loss in training steps."""
    caps = opts.resolved_capabilities()
    check_capabilities(opts.megatron, caps)
    megatron_args.scheduler_kwargs(opts.megatron, opts.algorithm)  # a schedule without horizon fails now
    megatron = opts.megatron
    arch = megatron_args.resolve_arch(
        load_arch(opts.hf_checkpoint), megatron, tp_size=topo.tp_size, pp_size=topo.pp_size
    )
    layout = bridge.Layout.current()
    dtype = megatron_args.params_dtype(megatron)
    hf_bridge = bridge.open_bridge(
        arch,
        bridge.hf_config(opts.hf_checkpoint),
        dtype=dtype,
        parallel=bridge.parallel_states(
            tp_size=topo.tp_size, pp_size=topo.pp_size, ep_size=layout.ep_size, etp_size=layout.etp_size
        ),
    )
    config = megatron_args.transformer_config(
        arch, megatron, caps, tp_size=topo.tp_size, pp_size=topo.pp_size, base=hf_bridge.config, mtp=mtp_block
    )
    provider = opts.algorithm.custom_model_provider_path
    if provider is not None:  # slime's --custom-model-provider-path builds the chunk instead
        chunk = provided_chunk(provider, config, topo, train_mtp=train_mtp)
    else:
        chunk = build_chunk(
            arch,
            config,
            topo,
            megatron_args.max_sequence_length(arch, megatron),
            transformer_engine=uses_transformer_engine_spec(megatron, caps),
            train_mtp=train_mtp,
            gdn_backend=megatron.qwen_gdn_backend,
        )
    weights = bridge.WeightBridge(arch, hf_bridge, arch.padded_vocab_size(topo.tp_size), config)
    bridge.attach(chunk, weights)
    return arch, config, chunk, weights


def load_hf_weights(
    chunks: list[Any],
    arch: ModelArch,
    hf_dir: str | Path,
    topo: Topology,
    weights: bridge.WeightBridge | None = None,
) -> None:
    """Fill every weight of `chunks` from the HF checkpoint, sharded for this rank.

    `weights`: the chunks' bridge (default: the one `build_actor`/`build_reference` attached).
    """
    del arch, topo  # the bridge holds the architecture; the layout comes from Megatron's state
    source = HFWeights(hf_dir)
    layout = bridge.Layout.current()
    for chunk in chunks:
        (weights or bridge.weights_of(chunk)).load(chunk, source, layout)


def reduce_experts_over_expert_data_parallel(chunk: Any, config: Any) -> None:
    """Expert weights narrower in TP than the dense layers (--expert-tensor-parallel-size below
    --tensor-model-parallel-size) are whole on several dense-TP ranks, each of which routes its own
    tokens through them: their gradients must be summed over the expert data-parallel group, which
    holds those ranks. Megatron marks them for that reduction (`allreduce=False`) only under
    expert parallelism (EP > 1); at EP = 1 it would reduce them over the dense data-parallel group
    alone, missing the other TP ranks' tokens."""
    if config.expert_tensor_parallel_size == config.tensor_model_parallel_size:
        return
    for module in chunk.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def build_actor(
    opts: ModelOptions, topo: Topology, *, load_weights: bool = True, value_head: bool = False
) -> Actor:
    """Actor chunks wrapped in Megatron DDP, with optimizer and LR scheduler.

    `load_weights=False` skips reading HF weights (a checkpoint load follows). `value_head`: the
    PPO critic, whose output layer is a fresh 1-wide value head (`tether.train.model.value_head`).
    """
    with quiet_megatron_imports():
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

    megatron = opts.megatron
    # The critic's value head predicts values, not tokens: no MTP block (its checkpoint's MTP
    # tensors are not loaded, as without --mtp-num-layers).
    train_mtp = megatron.enable_mtp_training and not value_head
    arch, config, chunk, weights = _prepare(opts, topo, mtp_block=not value_head, train_mtp=train_mtp)
    if load_weights:
        load_hf_weights([chunk], arch, opts.hf_checkpoint, topo, weights)
    if value_head:
        attach_value_head(chunk, config, seed=opts.algorithm.seed)
    # --freeze/--only-train-params-name-list, before DDP and the optimizer (which skip frozen params)
    report = topo.dp_rank == 0 and topo.tp_rank == 0
    apply_freeze(chunk, opts.algorithm, report=report, where=f" pp stage {topo.pp_rank}")
    if opts.algorithm.freeze_indexer:
        frozen = freeze_indexers(chunk)
        if report:
            print(
                f"trainer pp stage {topo.pp_rank}: --freeze-indexer froze {len(frozen)} parameters",
                file=sys.stderr,
            )
    if not train_mtp:
        mtp.freeze(chunk)  # slime: without --enable-mtp-training the MTP layers are not trained
    reduce_experts_over_expert_data_parallel(chunk, config)
    ddp = DistributedDataParallel(config=config, ddp_config=megatron_args.ddp_config(megatron), module=chunk)
    # DDP copies params into its contiguous buffers; broadcast keeps DP replicas identical.
    ddp.broadcast_params()
    # The hooks Megatron-LM's training loop installs: per-micro-batch sync off until the last one,
    # the reduction started by the schedule when it overlaps the backward pass.
    config.no_sync_func = ddp.no_sync
    if megatron.overlap_grad_reduce:
        config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(megatron_args.optimizer_config(megatron, opts.algorithm), [ddp])
    if megatron.use_stateless_adam:
        stateless_adam.install(optimizer)
    # Loss scaling (--fp16, --loss-scale) multiplies the loss before backward; 1 in float32.
    config.grad_scale_func = optimizer.scale_loss
    # Megatron's scheduler counts in samples/steps; tether steps it once per optimizer step.
    scheduler = megatron_args.build_scheduler(optimizer, megatron, opts.algorithm)
    return Actor(
        arch=arch, config=config, chunks=[ddp], optimizer=optimizer, scheduler=scheduler, weights=weights
    )


def build_reference(opts: ModelOptions, topo: Topology, *, load_weights: bool = True) -> Reference:
    """A frozen model with the actor's shape, for KL; weights from HF unless a checkpoint follows."""
    arch, config, chunk, weights = _prepare(opts, topo)
    if load_weights:
        load_hf_weights([chunk], arch, opts.hf_checkpoint, topo, weights)
    for p in chunk.parameters():
        p.requires_grad_(False)
    chunk.eval()
    return Reference(arch=arch, config=config, chunks=[chunk], weights=weights)


def sync_params(chunks: list[Any]) -> None:
    """Finish a pending parameter all-gather (--overlap-param-gather) before weights are read
    outside a forward pass (export, checkpoint): the distributed optimizer's step leaves it to the
    next forward's hooks, as Megatron-LM does around its checkpoint saves."""
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()


unwrap = bridge.unwrap

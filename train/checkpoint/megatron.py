"""What Megatron-LM reads from a torch_dist checkpoint besides the tensors, and how a load asks
a checkpoint for its tensors (names it has, `_extra_state` left out).

Megatron-LM's load reads the common state's "iteration", "checkpoint_version", "args" (an
argparse Namespace: `check_checkpoint_args` compares num_layers, hidden_size,
num_attention_heads, add_position_embedding, and TP/PP sizes decide whether optimizer and RNG
state load), "opt_param_scheduler", and "content_metadata" (how the optimizer state was laid out).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from tether.train.checkpoint.names import is_extra_state, rename_for_checkpoint
from tether.train.model.build import unwrap
from tether.train.model.megatron_cpu import quiet_megatron_imports

CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version of torch_dist checkpoints
# Megatron-LM argument name -> TransformerConfig attribute.
_ARGS_FROM_CONFIG = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "swiglu": "gated_linear_unit",
    "normalization": "normalization",
    "norm_epsilon": "layernorm_epsilon",
    "qk_layernorm": "qk_layernorm",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
    "attention_dropout": "attention_dropout",
    "hidden_dropout": "hidden_dropout",
    "num_experts": "num_moe_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_layer_freq": "moe_layer_freq",
    "multi_latent_attention": "multi_latent_attention",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
    "bf16": "bf16",
    "fp16": "fp16",
    "sequence_parallel": "sequence_parallel",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size",
}


def megatron_args(chunks: list[Any], config: Any, *, iteration: int, optimizer: bool) -> argparse.Namespace:
    """The "args" of the common state: the model's shape and the run's parallel layout, under
    Megatron-LM's argument names. Collective-free (reads Megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    model = unwrap(chunks[0])
    ns = argparse.Namespace()
    for name, attr in _ARGS_FROM_CONFIG.items():
        setattr(ns, name, getattr(config, attr, None))
    ns.group_query_attention = (ns.num_query_groups or ns.num_attention_heads) != ns.num_attention_heads
    ns.max_position_embeddings = getattr(model, "max_sequence_length", None)
    ns.seq_length = ns.max_position_embeddings
    ns.padded_vocab_size = getattr(model, "vocab_size", None)
    ns.position_embedding_type = getattr(model, "position_embedding_type", "rope")
    ns.add_position_embedding = ns.position_embedding_type == "learned_absolute"
    ns.use_rotary_position_embeddings = ns.position_embedding_type == "rope"
    ns.rotary_base = getattr(model, "rotary_base", None)
    ns.rotary_percent = getattr(model, "rotary_percent", 1.0)
    ns.rotary_interleaved = bool(getattr(config, "rotary_interleaved", False))
    ns.untie_embeddings_and_output_weights = not getattr(model, "share_embeddings_and_output_weights", False)
    ns.squared_relu = False
    ns.tokenizer_type = "HuggingFaceTokenizer"
    ns.vocab_file = None
    ns.tensor_model_parallel_size = ps.get_tensor_model_parallel_world_size()
    ns.pipeline_model_parallel_size = ps.get_pipeline_model_parallel_world_size()
    ns.virtual_pipeline_model_parallel_size = None
    ns.data_parallel_size = ps.get_data_parallel_world_size()
    ns.context_parallel_size = ps.get_context_parallel_world_size()
    ns.world_size = (
        ns.tensor_model_parallel_size
        * ns.pipeline_model_parallel_size
        * ns.data_parallel_size
        * ns.context_parallel_size
    )
    ns.ckpt_format = "torch_dist"
    ns.use_dist_ckpt = True
    ns.use_distributed_optimizer = True
    ns.no_save_optim = not optimizer
    # tether keeps each rank's RNG in tether/rng/ (msgpack): Megatron-LM then seeds instead.
    ns.no_save_rng = True
    ns.iteration = iteration
    ns.consumed_train_samples = 0
    ns.skipped_train_samples = 0
    ns.consumed_valid_samples = 0
    for name, value in vars(ns).items():  # common.pt loads with torch's weights_only unpickler
        if not _plain(value):
            setattr(ns, name, str(value))
    return ns


def _plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def common_state(chunks: list[Any], config: Any, *, iteration: int, scheduler: Any | None) -> dict[str, Any]:
    """The non-tensor entries of Megatron-LM's checkpoint state dict."""
    state: dict[str, Any] = {
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "args": megatron_args(chunks, config, iteration=iteration, optimizer=scheduler is not None),
        "num_floating_point_operations_so_far": 0,
    }
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _sharded_items(tree: Any) -> Iterator[tuple[Any, Any, Any]]:
    """(container, key, value) of every leaf of a nested sharded state dict."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, dict | list):
            yield from _sharded_items(value)
        else:
            yield tree, key, value


def drop_extra_state(sharded: dict[str, Any], keep: Collection[str] = ()) -> int:
    """Remove `_extra_state` entries (TE's FP8 metadata; the local spec's are empty) from a load
    request, but those whose checkpoint key is in `keep`: a checkpoint from the other layer spec
    (or a converter) need not hold them, and the local spec has nothing to restore from them."""
    with quiet_megatron_imports():
        from megatron.core.dist_checkpointing.mapping import ShardedObject

    dropped = 0
    for key in [
        k
        for k, v in sharded.items()
        if isinstance(v, ShardedObject) and is_extra_state(v.key) and v.key not in keep
    ]:
        del sharded[key]
        dropped += 1
    return dropped


def uses_transformer_engine(chunks: list[Any]) -> bool:
    """The model is built from TransformerEngine modules (the GPU layer spec): their
    `_extra_state` (FP8 scaling factors and amax history) is worth restoring."""
    return any(
        cls.__module__.startswith("transformer_engine")
        for chunk in chunks
        for module in unwrap(chunk).modules()
        for cls in type(module).__mro__
    )


def object_keys(ckpt_dir: Path) -> set[str]:
    """The ShardedObject keys (`_extra_state`, optimizer param groups) a torch_dist checkpoint
    holds: its index's byte entries, `key/shard_<offset>_<shape>`, without the shard part."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    return {k.split("/shard_", 1)[0] for k, v in index.items() if isinstance(v, BytesStorageMetadata)}


def extra_state_to_load(chunks: list[Any], ckpt_dir: Path) -> set[str]:
    """The `_extra_state` keys a load asks for: on a TransformerEngine model those the checkpoint
    holds (TE's `set_extra_state` restores the FP8 state from them); none on the local spec."""
    if not uses_transformer_engine(chunks):
        return set()
    return {k for k in object_keys(ckpt_dir) if is_extra_state(k)}


def tensors_metadata(ckpt_dir: Path) -> dict[str, Any]:
    """The ShardedTensors a torch_dist checkpoint holds, by key: each one's global shape and dtype
    (its metadata; unpickles .metadata)."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_tensors_metadata(str(ckpt_dir)))


def tensor_keys(ckpt_dir: Path) -> set[str]:
    """The ShardedTensor keys a torch_dist checkpoint holds."""
    return set(tensors_metadata(ckpt_dir))


def ask_checkpoint_names(model_sharded: dict[str, Any], available: set[str]) -> dict[str, str]:
    """Point each model tensor of a load request at the name the checkpoint has it under
    (TE ↔ local spec), in place; returns the renames. KeyError names what the checkpoint lacks."""
    with quiet_megatron_imports():
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    requests = [v for v in model_sharded.values() if isinstance(v, ShardedTensor | ShardedTensorFactory)]
    renames = rename_for_checkpoint({v.key for v in requests}, available)
    for value in requests:
        if value.key in renames:
            value.key = renames[value.key]
    return renames


def content_metadata(ckpt_dir: Path) -> dict[str, Any] | None:
    """How the checkpoint's optimizer state is laid out (`save(..., content_metadata=)`)."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    found = dist_checkpointing.load_content_metadata(str(ckpt_dir))
    return dict(found) if found else None


def load_common(ckpt_dir: Path) -> dict[str, Any]:
    """The checkpoint's common (non-tensor) state: iteration, args, scheduler (unpickles common.pt)."""
    with quiet_megatron_imports():
        from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_common_state_dict(str(ckpt_dir)))


def saved_parallel_sizes(common: dict[str, Any]) -> tuple[int, int]:
    """(TP, PP) a checkpoint was saved at, from its args (1, 1 when it does not say)."""
    args = common.get("args")
    return (
        int(getattr(args, "tensor_model_parallel_size", 1) or 1),
        int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
    )

"""A tiny Qwen3-Next checkpoint made by transformers itself (Qwen3NextConfig + Qwen3NextForCausalLM,
save_pretrained), for the trainer's model checks: both token mixers (linear attention in layers 0
and 2, gated full attention in 1 and 3 with full_attention_interval 2), two value heads per key head,
partial RoPE, four experts with a gated shared expert, a dense layer (mlp_only_layers)."""

from __future__ import annotations

from pathlib import Path

import torch


def write_qwen3_next(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model (float32 safetensors and config.json) to `path`; returns it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        full_attention_interval=2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).float()
    out = Path(path)
    model.save_pretrained(str(out))
    return out

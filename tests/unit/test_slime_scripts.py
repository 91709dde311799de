"""slime's own launch scripts pass `tether plan` unchanged (issue #19).

Each entry is the argument list a script of THUDM/slime passes to `train.py`, in the script's order
(its MODEL_ARGS from scripts/models/<model>.sh, then CKPT_ARGS, ROLLOUT_ARGS, ... as it expands them),
with slime's values. Only the paths are replaced, by files and directories the test creates: a
config.json with the architecture the MODEL_ARGS assert for --hf-checkpoint, JSONL prompt files,
checkpoint directories, and the --sglang-config YAML a script writes. Each list is resolved by
tether's parser, its hooks checked and its placement planned on one 8-GPU node, exactly as
`tether plan` does, without starting anything.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tether.config import Config, horizon_note, resolve, with_counted_epochs
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.rollout.engine_api.launch import EngineLaunchConfig, sglang_flags
from tether.rollout.hooks.checks import check_hooks
from tether.runtime.errors import ConfigError
from tether.train.config import stage_layers
from tether.train.model import megatron_args
from tether.train.model.capabilities import Capabilities, check_capabilities
from tether.train.model.hf_config import load_arch

# --- model configs: the Hugging Face config.json each MODEL_ARGS describes ------------------------

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000}
_QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000}
HF_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3-4B": {
        **_QWEN3,
        "num_hidden_layers": 36,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen3-32B": {
        **_QWEN3,
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "qwen2.5-0.5B": {
        **_QWEN2,
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3B": {
        **_QWEN2,
        "num_hidden_layers": 36,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    # GLM-Z1-9B-0414: sandwich norms, half interleaved RoPE, q/k/v biases.
    "glm4-9B": {
        "model_type": "glm4",
        "vocab_size": 151552,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "partial_rotary_factor": 0.5,
        "num_hidden_layers": 40,
        "hidden_size": 4096,
        "intermediate_size": 13696,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
    # MiMo-7B-RL: Qwen2 plus one multi-token-prediction layer (model.mtp_layers.0).
    "mimo-7B": {
        **_QWEN2,
        "model_type": "mimo",
        "vocab_size": 151680,
        "rms_norm_eps": 1e-5,
        "rope_theta": 640000,
        "max_position_embeddings": 32768,
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    },
}

# --- the scripts' argument lists ---------------------------------------------------------------

# slime: scripts/run-qwen3-4B.sh (MODEL_ARGS: scripts/models/qwen3-4B.sh), NUM_GPUS=8
QWEN3_4B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936",
    "--kv-channels", "128", "--qk-layernorm",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-4B", "--ref-load", "/root/Qwen3-4B_torch_dist",
    "--load", "/root/Qwen3-4B_slime/", "--save", "/root/Qwen3-4B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen3-4B-amd.sh (MODEL_ARGS: scripts/models/qwen3-4B.sh), NUM_GPUS=8
QWEN3_4B_AMD = [
    *QWEN3_4B[:5], "--no-offload-train", "--no-offload-rollout",  # after the cluster flags
    *QWEN3_4B[5:], "--no-gradient-accumulation-fusion",  # otherwise run-qwen3-4B.sh's arguments
]  # fmt: skip

# slime: scripts/run-qwen3-32B.sh (MODEL_ARGS: scripts/models/qwen3-32B.sh), NUM_GPUS=8
QWEN3_32B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "64", "--hidden-size", "5120", "--ffn-hidden-size", "25600",
    "--num-attention-heads", "64", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936",
    "--kv-channels", "128", "--qk-layernorm", "--untie-embeddings-and-output-weights",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-32B", "--ref-load", "/root/Qwen3-32B_torch_dist/",
    "--load", "/root/Qwen3-32B_slime", "--save", "/root/Qwen3-32B_slime", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "5", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "8", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20480",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", "16", "24", "32", "40", "48", "56", "64", "72",
    "80", "88", "96", "104", "112", "120", "128", "136", "144", "152", "160", "168", "176", "184",
    "192", "200", "208", "216", "224", "232", "240", "248", "256",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-glm4-9B.sh (MODEL_ARGS: scripts/models/glm4-9B.sh), NUM_GPUS=8: context
# parallelism (CP=2) under TP=2 with sequence parallelism.
GLM4_9B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
    "--spec", "slime_plugins.models.glm4", "get_glm_spec", "--swiglu", "--num-layers", "40",
    "--hidden-size", "4096", "--ffn-hidden-size", "13696", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "2", "--use-rotary-position-embeddings",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
    "--rotary-base", "10000", "--vocab-size", "151552", "--post-self-attn-layernorm",
    "--post-mlp-layernorm", "--rotary-interleaved", "--rotary-percent", "0.5",
    "--no-rope-fusion", "--untie-embeddings-and-output-weights", "--hf-checkpoint", "/root/GLM-Z1-9B-0414/",
    "--ref-load", "/root/GLM-Z1-9B-0414_torch_dist", "--load", "/root/GLM-Z1-9B-0414_slime/",
    "--save", "/root/GLM-Z1-9B-0414_slime/", "--save-interval", "20", "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl",
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000",
    "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
    "--rollout-temperature", "1", "--global-batch-size", "256", "--balance-data",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--advantage-estimator", "grpo",
    "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "2",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4608",
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    "--rollout-num-gpus-per-engine", "2", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen2.5-0.5B-gb10-smoke.sh (MODEL_ARGS: scripts/models/qwen2.5-0.5B.sh)
QWEN25_05B_SMOKE = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
    "--num-attention-heads", "14", "--use-rotary-position-embeddings", "--disable-bias-linear",
    "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--group-query-attention", "--num-query-groups", "2",
    "--vocab-size", "151936",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen2.5-0.5B-Instruct/",
    "--ref-load", "/root/Qwen2.5-0.5B-Instruct_torch_dist/", "--save", "/tmp/slime_smoke_save/",
    "--save-interval", "9999",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl",
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
    "--rm-type", "deepscaler", "--num-rollout", "1", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1", "--global-batch-size", "4",
    "--rollout-max-response-len", "256", "--rollout-temperature", "1",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.4",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen2.5-0.5B-reproducibility.sh (MODEL_ARGS: scripts/models/qwen2.5-0.5B.sh)
QWEN25_05B_REPRODUCIBILITY = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    "--calculate-per-token-loss",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
    "--num-attention-heads", "14", "--use-rotary-position-embeddings",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--group-query-attention", "--num-query-groups", "2",
    "--vocab-size", "151936",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen2.5-0.5B-Instruct/",
    "--ref-load", "/root/Qwen2.5-0.5B-Instruct_torch_dist/",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/gsm8k/train.parquet", "--input-key", "messages", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "100",
    "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1024",
    "--rollout-temperature", "1", "--global-batch-size", "256",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # WANDB_ARGS
    "--use-wandb", "--wandb-host", "https://wandb.ai/", "--wandb-team", "glm-zero",
    "--wandb-project", "slime-dev", "--wandb-group", "qwen2.5-0.5B-gsm8k-deterministic",
    # PERF_ARGS
    "--tensor-model-parallel-size", "1",
    "--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "gsm8k", "/root/gsm8k/test.parquet",
    "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-top-k", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
    "--sglang-enable-deterministic-inference", "--sglang-attention-backend", "flashinfer",
    "--deterministic-mode",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: examples/search-r1/run_qwen2.5_3B.sh (MODEL_ARGS: scripts/models/qwen2.5-3B.sh); its hooks
# live in the example's generate_with_search.py, which the test stands in for.
SEARCH_R1_QWEN25_3B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--colocate",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "36", "--hidden-size", "2048", "--ffn-hidden-size", "11008",
    "--num-attention-heads", "16", "--use-rotary-position-embeddings", "--disable-bias-linear",
    "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--group-query-attention", "--num-query-groups", "2",
    "--vocab-size", "151936",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen2.5-3B/", "--ref-load", "/root/Qwen2.5-3B_torch_dist/",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/Search-R1/data/nq_hotpotqa_train/train.parquet", "--input-key", "prompt",
    "--label-key", "reward_model", "--apply-chat-template", "--rollout-shuffle",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "512", "--rollout-temperature", "1", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    # CUSTOM_ARGS
    "--custom-generate-function-path", "generate_with_search.generate",
    "--custom-rm-path", "generate_with_search.reward_func",
]  # fmt: skip

# slime: examples/fully_async/run-qwen2.5-0.5B-fully_async.sh (train_async.py; MODEL_ARGS:
# scripts/models/qwen2.5-0.5B.sh), NUM_GPUS=4, ACTOR_GPUS=1
QWEN25_05B_FULLY_ASYNC = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "3",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
    "--num-attention-heads", "14", "--use-rotary-position-embeddings", "--disable-bias-linear",
    "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "1000000", "--group-query-attention", "--num-query-groups", "2",
    "--vocab-size", "151936",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/models/Qwen2.5-0.5B-Instruct",
    "--ref-load", "/root/models/Qwen2.5-0.5B-Instruct_torch_dist",
    "--save", "/tmp/slime_fully_async_demo/", "--save-interval", "9999",
    # ROLLOUT_ARGS
    "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
    "--prompt-data", "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl",
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
    "--rm-type", "deepscaler",
    "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "1024", "--rollout-temperature", "1",
    "--global-batch-size", "32", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.55",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-mimo-7B-rl-eagle.sh (MODEL_ARGS: scripts/models/mimo-7B-rl.sh), NUM_GPUS=8: the
# MTP layer trained beside the policy (--mtp-num-layers, --enable-mtp-training) and served by SGLang as
# the EAGLE draft.
MIMO_7B_EAGLE = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--rotary-base", "640000",
    "--vocab-size", "151680", "--untie-embeddings-and-output-weights",
    "--max-position-embeddings", "32768", "--mtp-num-layers", "1",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/MiMo-7B-RL", "--ref-load", "/root/MiMo-7B-RL_torch_dist",
    "--load", "/root/MiMo-7B-RL-mtp_slime/", "--save", "/root/MiMo-7B-RL-mtp_slime/",
    "--save-interval", "2000",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "8192", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-attention-backend", "fa3",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    # SPEC_ARGS
    "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2",
]  # fmt: skip

# slime: scripts/run-qwen3-4B-base-sft.sh (MODEL_ARGS: scripts/models/qwen3-4B.sh), launched with
# train_async.py; its EVAL_ARGS is never set (empty).
QWEN3_4B_BASE_SFT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8",
    # MODEL_ARGS
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936",
    "--kv-channels", "128", "--qk-layernorm",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-4B-Base/", "--ref-load", "/root/Qwen3-4B-Base_torch_dist",
    "--load", "/root/Qwen3-4B-Base_slime/", "--save", "/root/Qwen3-4B-Base_slime/",
    "--save-interval", "1000",
    # SFT_ARGS
    "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
    "--prompt-data", "/root/openhermes2_5.parquet", "--input-key", "messages", "--rollout-shuffle",
    "--num-epoch", "3", "--rollout-batch-size", "128", "--global-batch-size", "128",
    "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
    "--debug-train-only",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
    "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    # PERF_ARGS
    "--tensor-model-parallel-size", "1", "--sequence-parallel",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen3-30B-A3B.sh (MODEL_ARGS: scripts/models/qwen3-30B-A3B.sh): TP=4 with the
# experts at ETP=1 over EP=8, slime's MoE layout.
HF_CONFIGS["qwen3-30B-A3B"] = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}
QWEN3_30B_A3B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "768", "--moe-router-score-function", "softmax",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-layer-freq", "[" + ",".join(["1"] * 48) + "]", "--num-experts", "128", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-30B-A3B", "--ref-load", "/root/Qwen3-30B-A3B_torch_dist",
    "--load", "/root/Qwen3-30B-A3B_slime/", "--save", "/root/Qwen3-30B-A3B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20480",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)],
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# The MODEL_ARGS of scripts/models/qwen3-30B-A3B.sh, as run-qwen3-30B-A3B.sh passes them (its
# siblings below source the same file).
QWEN3_30B_A3B_MODEL_ARGS = QWEN3_30B_A3B[
    QWEN3_30B_A3B.index("--disable-bias-linear") : QWEN3_30B_A3B.index("--hf-checkpoint")
]

# slime: scripts/low_precision/run-qwen3-30B-A3B-int4.sh (MODEL_ARGS: scripts/models/qwen3-30B-A3B.sh):
# run-qwen3-30B-A3B.sh's model on an INT4 checkpoint, trained with fake INT4 quantization
# (OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1, OPEN_TRAINING_INT4_GROUP_SIZE=128 in its Ray env), engines of 1 GPU.
QWEN3_30B_A3B_INT4 = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    *QWEN3_30B_A3B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-30B-A3B-INT4/", "--ref-load", "/root/Qwen3-30B-A3B_torch_dist/",
    "--load", "/root/Qwen3-30B-A3B_slime/", "--save", "/root/Qwen3-30B-A3B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "100", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "0.8", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28", "--use-tis",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    # EVAL_ARGS (one path, no name: slime's legacy form)
    "--eval-interval", "10", "--eval-prompt-data", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)],
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: examples/multi_agent/run-qwen3-30B-A3B-multi-agent.sh (MODEL_ARGS:
# scripts/models/qwen3-30B-A3B.sh); its generate hook lives in the example's
# rollout_with_multi_agents.py, which the test stands in for. Its EVAL_ARGS keep only the sampling
# flags (the eval data is commented out: "multi-agent do not support eval for now").
MULTI_AGENT_QWEN3_30B_A3B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    *QWEN3_30B_A3B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-30B-A3B", "--ref-load", "/root/Qwen3-30B-A3B_torch_dist",
    "--load", "/root/Qwen3-4B_slime/", "--save", "/root/Qwen3-4B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--custom-generate-function-path",
    "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents",
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-context-len", "16384", "--rollout-max-response-len", "8192",
    "--rollout-temperature", "1", "--global-batch-size", "256", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28", "--use-rollout-logprobs",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20480",
    # EVAL_ARGS
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)],
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-moonlight-16B-A3B.sh (MODEL_ARGS: scripts/models/moonlight.sh): DeepSeek-V3's
# architecture at 16B (MLA without a q LoRA, 64 experts in one group, one dense first layer), Megatron's
# experts dispatched by DeepEP (--moe-enable-deepep with the flex dispatcher).
HF_CONFIGS["moonlight-16B-A3B"] = {  # moonshotai/Moonlight-16B-A3B's config.json
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "kv_lora_rank": 512,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 163840,
}
MOONLIGHT_16B_A3B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--disable-bias-linear", "--num-layers", "27", "--hidden-size", "2048", "--ffn-hidden-size", "11264",
    "--num-attention-heads", "16", "--kv-channels", "128", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--norm-epsilon", "1e-5", "--rotary-percent", "1.0", "--swiglu",
    "--untie-embeddings-and-output-weights", "--no-masked-softmax-fusion", "--vocab-size", "163840",
    "--multi-latent-attention", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm", "--rotary-scaling-factor", "1",
    "--rotary-base", "50000", "--mscale", "1.0", "--mscale-all-dim", "1.0", "--attention-softmax-in-fp32",
    "--no-rope-fusion",
    "--num-experts", "64", "--moe-layer-freq", "[" + ",".join(["0"] * 1 + ["1"] * 26) + "]",
    "--moe-ffn-hidden-size", "1408", "--moe-router-topk", "6",
    "--moe-shared-expert-intermediate-size", str(1408 * 2), "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0", "--moe-router-group-topk", "1",
    "--moe-router-num-groups", "1", "--moe-grouped-gemm", "--moe-router-topk-scaling-factor", "2.446",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Moonlight-16B-A3B", "--ref-load", "/root/Moonlight-16B-A3B_torch_dist",
    "--load", "/root/Moonlight-16B-A3B_slime/", "--save", "/root/Moonlight-16B-A3B_slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
    "--num-rollout", "3000", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "4096", "--rollout-temperature", "1",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "4096", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)],
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--moe-enable-deepep", "--moe-token-dispatcher-type", "flex",
]  # fmt: skip


def _replaced(argv: list[str], changes: dict[str, str]) -> list[str]:
    """`argv` with the value after each flag of `changes` replaced (a sibling script's edits)."""
    out = [*argv]
    for flag, value in changes.items():
        out[out.index(flag) + 1] = value
    return out


# slime: scripts/low_precision/run-moonlight-16B-A3B-int4.sh (MODEL_ARGS: scripts/models/moonlight.sh):
# run-moonlight-16B-A3B.sh on 4 GPUs (TP 2, EP 4, engines of 4) from an INT4 checkpoint of
# Moonlight-16B-A3B-Instruct, trained with fake INT4 quantization (OPEN_TRAINING_INT4_GROUP_SIZE=128);
# otherwise its arguments.
MOONLIGHT_16B_A3B_INT4 = _replaced(
    MOONLIGHT_16B_A3B,
    {
        "--actor-num-gpus-per-node": "4",
        "--hf-checkpoint": "/root/Moonlight-16B-A3B-Instruct-INT4",
        "--ref-load": "/root/Moonlight-16B-A3B-Instruct-INT4_torch_dist",
        "--rollout-temperature": "0.8",
        "--eval-top-p": "0.7",
        "--tensor-model-parallel-size": "2",
        "--expert-model-parallel-size": "4",
        "--rollout-num-gpus-per-engine": "4",
    },
)

# slime: scripts/run-glm4.7-30B-A3B.sh (MODEL_ARGS: scripts/models/glm4.7-30B-A3B.sh): GLM-4.7-Flash,
# DeepSeek-V3's attention (value heads wider than the query's nope part) with GLM's router, its MTP
# layer trained (MTP_ARGS) and served as the EAGLE draft, Megatron's experts dispatched by DeepEP.
HF_CONFIGS["glm4.7-flash"] = {  # zai-org/GLM-4.7-Flash's config.json
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 20,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 47,
    "num_key_value_heads": 20,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_interleave": True,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.8,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "v_head_dim": 256,
    "vocab_size": 154880,
}
GLM47_FLASH = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--moe-layer-freq", "[0]*1+[1]*46", "--num-experts", "64",
    "--moe-shared-expert-intermediate-size", "1536", "--moe-router-topk", "4", "--moe-grouped-gemm",
    "--moe-permute-fusion", "--moe-ffn-hidden-size", "1536", "--moe-router-score-function", "sigmoid",
    "--moe-router-pre-softmax", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk-scaling-factor", "1.8",
    "--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32", "--make-vocab-size-divisible-by", "64",
    "--num-layers", "47", "--hidden-size", "2048", "--ffn-hidden-size", "10240",
    "--num-attention-heads", "20", "--disable-bias-linear", "--add-qkv-bias", "--swiglu",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
    "--normalization", "RMSNorm", "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "768",
    "--kv-lora-rank", "512", "--qk-head-dim", "192", "--v-head-dim", "256", "--kv-channels", "192",
    "--qk-pos-emb-head-dim", "64", "--vocab-size", "154880", "--rotary-base", "1000000", "--no-rope-fusion",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/GLM-4.7-Flash", "--ref-load", "/root/GLM-4.7-Flash_torch_dist/",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1.0", "--global-batch-size", "1024",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00", "--entropy-coef", "0.00",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
    "--context-parallel-size", "2", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "23",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "32768",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime24", "/root/rl_data/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "32768",
    "--eval-temperature", "1.0", "--eval-top-p", "0.95",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.8",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-enable-dp-lm-head",
    "--sglang-moe-dense-tp-size", "1",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-cuda-graph-max-bs", "64", "--sglang-max-running-requests", "512",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
    # MTP_ARGS
    "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2",
]  # fmt: skip

# --- Qwen3.5 and Qwen3-Next: gated-DeltaNet linear attention under slime's layer-spec plugins ------


def _qwen3_5_config(text: dict[str, object], out_hidden_size: int, moe: bool = False) -> dict[str, object]:
    """config.json as Qwen publishes a Qwen3.5 checkpoint: a vision-language model (top-level
    model_type qwen3_5 / qwen3_5_moe) whose decoder's fields sit under text_config (three gated-DeltaNet
    layers to one gated full-attention layer, mRoPE over a quarter of each head, one MTP layer) beside
    its vision tower; tie_word_embeddings at the top. `text`: the sizes of this one."""
    layers = int(str(text["num_hidden_layers"]))
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "eos_token_id": 248044,
            "full_attention_interval": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
            * (layers // 4),
            "head_dim": 256,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_value_head_dim": 128,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000,
                "rope_type": "default",
            },
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 248320,
            **text,
        },
        "vision_config": {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "deepstack_visual_indexes": [],
            "depth": 27,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 4304,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": out_hidden_size,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


HF_CONFIGS["qwen3.5-9B"] = _qwen3_5_config(  # Qwen/Qwen3.5-9B's config.json
    {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 32,
        "mlp_only_layers": [],
    },
    out_hidden_size=4096,
)
HF_CONFIGS["qwen3.5-27B"] = _qwen3_5_config(  # Qwen/Qwen3.5-27B's config.json
    {
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 48,
        "mlp_only_layers": [],
    },
    out_hidden_size=5120,
)
HF_CONFIGS["qwen3.5-35B-A3B"] = _qwen3_5_config(  # Qwen/Qwen3.5-35B-A3B's config.json
    {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    out_hidden_size=2048,
    moe=True,
)
# Qwen3.6-35B-A3B: Qwen3.5-35B-A3B's architecture, published the same way.
HF_CONFIGS["qwen3.6-35B-A3B"] = HF_CONFIGS["qwen3.5-35B-A3B"]

# slime: scripts/models/qwen3.5-35B-A3B.sh's MODEL_ARGS (MOE_LAYER_FREQ as its printf writes it for
# NLAYERS=40, FIRST_K_DENSE_REPLACE=0: [1,...,1]): Qwen3.5's layers through slime's plugin spec.
QWEN35_35B_A3B_MODEL_ARGS = [
    "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec",
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "16",
    "--num-query-groups", "2", "--kv-channels", "256", "--num-layers", "40", "--hidden-size", "2048",
    "--ffn-hidden-size", "512", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "248320", "--rotary-base", "10000000",
    # moe
    "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "512",
    "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-layer-freq", "[" + ",".join(["1"] * 40) + "]", "--num-experts", "256", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
    # qwen3.5 specific
    "--attention-output-gate", "--moe-shared-expert-gate",
]  # fmt: skip

# slime: scripts/run-qwen3.5-35B-A3B-sft.sh (MODEL_ARGS: scripts/models/qwen3.5-35B-A3B.sh), launched
# with train_async.py on one node, the trainer only (TP 2, experts at ETP 1 over EP 8, dispatched by
# DeepEP); BASE_FOLDER=/root (the script requires it set); its EVAL_ARGS is never set and its
# SPEC_ARGS are commented out (both empty).
QWEN35_35B_A3B_SFT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8",
    # MODEL_ARGS
    *QWEN35_35B_A3B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3.5-35B-A3B", "--ref-load", "/root/Qwen3.5-35B-A3B_torch_dist",
    "--load", "/root/Qwen3.5-35B-A3B_slime/", "--save", "/root/Qwen3.5-35B-A3B_slime/",
    "--save-interval", "20",
    # SFT_ARGS
    "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
    "--prompt-data", "/root/openhermes2_5.parquet", "--input-key", "messages", "--rollout-shuffle",
    "--num-epoch", "3", "--rollout-batch-size", "128", "--global-batch-size", "128",
    "--loss-type", "sft_loss", "--loss-mask-type", "qwen3_5", "--calculate-per-token-loss",
    "--disable-compute-advantages-and-returns", "--debug-train-only",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
    "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
]  # fmt: skip

# slime: examples/fully_async/run-qwen3.5-9B-fully_async.sh (train_async.py; MODEL_ARGS:
# scripts/models/qwen3.5-9B.sh), NUM_GPUS=8, ACTOR_GPUS=4 (ROLLOUT_GPUS=4), MODEL_DIR and DATA_PATH at
# their defaults.
QWEN35_9B_FULLY_ASYNC = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
    # MODEL_ARGS
    "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec",
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "16",
    "--num-query-groups", "4", "--kv-channels", "256", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "12288", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "248320", "--rotary-base", "10000000", "--attention-output-gate",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/models/Qwen3.5-9B", "--ref-load", "/root/models/Qwen3.5-9B_torch_dist",
    "--save", "/tmp/slime_fully_async_demo/", "--save-interval", "9999",
    # ROLLOUT_ARGS
    "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
    "--prompt-data", "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl",
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
    "--rm-type", "deepscaler",
    "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "2048", "--rollout-temperature", "1",
    "--global-batch-size", "32", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# script path in slime -> (its arguments, the model its MODEL_ARGS describe)
SCRIPTS: dict[str, tuple[list[str], str]] = {
    "scripts/run-qwen3-30B-A3B.sh": (QWEN3_30B_A3B, "qwen3-30B-A3B"),
    "scripts/run-mimo-7B-rl-eagle.sh": (MIMO_7B_EAGLE, "mimo-7B"),
    "scripts/run-qwen3-4B.sh": (QWEN3_4B, "qwen3-4B"),
    "scripts/run-qwen3-4B-base-sft.sh": (QWEN3_4B_BASE_SFT, "qwen3-4B"),
    "scripts/run-qwen3-4B-amd.sh": (QWEN3_4B_AMD, "qwen3-4B"),
    "scripts/run-qwen3-32B.sh": (QWEN3_32B, "qwen3-32B"),
    "scripts/run-glm4-9B.sh": (GLM4_9B, "glm4-9B"),
    "scripts/run-qwen2.5-0.5B-gb10-smoke.sh": (QWEN25_05B_SMOKE, "qwen2.5-0.5B"),
    "scripts/run-qwen2.5-0.5B-reproducibility.sh": (QWEN25_05B_REPRODUCIBILITY, "qwen2.5-0.5B"),
    "examples/search-r1/run_qwen2.5_3B.sh": (SEARCH_R1_QWEN25_3B, "qwen2.5-3B"),
    "examples/fully_async/run-qwen2.5-0.5B-fully_async.sh": (QWEN25_05B_FULLY_ASYNC, "qwen2.5-0.5B"),
    "examples/multi_agent/run-qwen3-30B-A3B-multi-agent.sh": (MULTI_AGENT_QWEN3_30B_A3B, "qwen3-30B-A3B"),
    "scripts/low_precision/run-qwen3-30B-A3B-int4.sh": (QWEN3_30B_A3B_INT4, "qwen3-30B-A3B"),
    "scripts/run-moonlight-16B-A3B.sh": (MOONLIGHT_16B_A3B, "moonlight-16B-A3B"),
    "scripts/low_precision/run-moonlight-16B-A3B-int4.sh": (MOONLIGHT_16B_A3B_INT4, "moonlight-16B-A3B"),
    "scripts/run-qwen3.5-35B-A3B-sft.sh": (QWEN35_35B_A3B_SFT, "qwen3.5-35B-A3B"),
    "examples/fully_async/run-qwen3.5-9B-fully_async.sh": (QWEN35_9B_FULLY_ASYNC, "qwen3.5-9B"),
}

# Flags whose values are paths, and what the test puts there instead.
_DIR_FLAGS = {"--ref-load", "--load", "--save"}
_DATA_FLAGS = {"--prompt-data"}
_PROMPT = {"prompt": "What is 1 + 1?", "messages": [{"role": "user", "content": "1 + 1?"}], "label": "2"}
# --sglang-config's value as a script passes it (the file it writes) -> the YAML the script writes there.
SGLANG_CONFIGS: dict[str, str] = {}


def with_local_paths(argv: list[str], model: str, tmp: Path) -> list[str]:
    """The script's arguments with each path replaced by one under `tmp` that exists."""
    hf = tmp / "hf" / model
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(HF_CONFIGS[model]))
    data = tmp / "data.jsonl"
    data.write_text(json.dumps(_PROMPT) + "\n")
    out: list[str] = []
    flag = ""
    for token in argv:
        if token.startswith("--"):
            flag = token
            out.append(token)
        elif flag == "--hf-checkpoint":
            out.append(str(hf))
        elif flag in _DIR_FLAGS:
            out.append(str(tmp / "ckpt" / Path(token).name))
        elif flag in _DATA_FLAGS or (flag == "--eval-prompt-data" and token.startswith("/")):
            out.append(str(data))
        elif flag == "--sglang-config":
            groups = tmp / Path(token).name
            groups.write_text(SGLANG_CONFIGS[token])
            out.append(str(groups))
        else:
            out.append(token)
    return out


def one_node(gpus: int) -> Inventory:
    return Inventory(
        nodes=[Node(hostname="n0", address="10.0.0.1", gpus=[Gpu(index=g) for g in range(gpus)])]
    )


def eight_gpu_nodes(count: int) -> Inventory:
    return Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(8)])
            for i in range(count)
        ]
    )


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def plan_for(argv: list[str], inventory: Inventory | None = None) -> tuple[Config, Plan]:
    """What `tether plan` does with these flags (resolve, check hooks, place), on an 8-GPU node
    unless another inventory is given."""
    cfg = resolve(argv)
    if not cfg.debug.debug_train_only:
        check_hooks(cfg.rollout)
    plan = plan_from_config(
        cfg.cluster,
        cfg.debug.debug_rollout_only,
        cfg.debug.debug_train_only,
        inventory or one_node(8),
        lambda _: None,
    )
    return cfg, plan


@pytest.fixture
def search_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for the search-r1 example's generate_with_search.py: its hooks' signatures."""
    module = tmp_path / "hooks" / "generate_with_search.py"
    module.parent.mkdir()
    module.write_text(
        textwrap.dedent(
            """
            async def generate(args, sample, sampling_params):
                return sample

            async def reward_func(args, sample, **kwargs):
                return 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(module.parent))


@pytest.fixture
def example_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stand-ins for the examples' modules the scripts name (imported as examples.*): the multi-agent
    example's generate hook (rollout_with_multi_agents.py) and the agent system it loads, and the coding
    agent example's generate hook (coding_agent_rl/generate.py), their signatures."""
    package = tmp_path / "example_hooks" / "examples" / "multi_agent"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    coding_agent = package.parent / "coding_agent_rl"
    coding_agent.mkdir()
    (coding_agent / "__init__.py").write_text("")
    (coding_agent / "generate.py").write_text(
        textwrap.dedent(
            """
            async def generate(args, base_sample, sampling_params, evaluation=False):
                return [base_sample]
            """
        )
    )
    (package / "rollout_with_multi_agents.py").write_text(
        textwrap.dedent(
            """
            async def generate_with_multi_agents(args, sample, sampling_params, evaluation=False):
                return [sample]
            """
        )
    )
    (package / "agent_system.py").write_text(
        textwrap.dedent(
            """
            async def run_agent_system(args, sample):
                return [sample]
            """
        )
    )
    monkeypatch.syspath_prepend(str(package.parent.parent))
    yield
    for name in [n for n in sys.modules if n == "examples" or n.startswith("examples.")]:
        del sys.modules[name]  # the stand-ins go with tmp_path


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_slime_script_plans_unchanged(
    script: str, tmp_path: Path, search_hooks: None, example_hooks: None
) -> None:
    argv, model = SCRIPTS[script]
    cfg, plan = plan_for(with_local_paths(argv, model, tmp_path))
    actor = plan.train_group("actor")
    assert actor is not None
    assert actor.world_size == int(argv[argv.index("--actor-num-gpus-per-node") + 1])
    if "--debug-train-only" in argv:  # slime's SFT recipe: the trainer only, no engine
        assert cfg.debug.debug_train_only and not plan.engines
    else:
        per_engine = int(argv[argv.index("--rollout-num-gpus-per-engine") + 1])
        assert {engine.tp_size for engine in plan.engines} == {per_engine}
    assert plan.colocate is cfg.cluster.colocate is ("--colocate" in argv)
    assert cfg.data.rollout_shuffle  # every one of them shuffles its prompts
    # The receipt round-trips (what `tether run` writes before it starts anything).
    assert Config.from_json(cfg.to_json()) == cfg
    assert msgspec.json.decode(plan.to_json())["mode"] == plan.mode


# slime: scripts/run-qwen3-235B-A22B.sh (MODEL_ARGS: scripts/models/qwen3-235B-A22B.sh): 8 actor
# nodes (TP=4, PP=4, CP=2, experts at ETP=1 over EP=16) and 64 rollout GPUs in engines of 32, each
# engine over four 8-GPU nodes, as slime places them.
HF_CONFIGS["qwen3-235B-A22B"] = {
    **HF_CONFIGS["qwen3-30B-A3B"],
    "num_hidden_layers": 94,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 1536,
}
QWEN3_235B_A22B = [
    "--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "64",
    "--update-weight-buffer-size", str(4 * 1024**3),
    # MODEL_ARGS
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "64",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "94", "--hidden-size", "4096",
    "--ffn-hidden-size", "12288", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "1536", "--moe-router-score-function", "softmax",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-layer-freq", "[" + ",".join(["1"] * 94) + "]", "--num-experts", "128", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-235B-A22B", "--ref-load", "/root/Qwen3-235B-A22B_torch_dist",
    "--load", "/root/Qwen3-235B-A22B_slime/", "--save", "/root/Qwen3-235B-A22B_slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "64",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "4e-4",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--context-parallel-size", "2", "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "22",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl", "--n-samples-per-eval-prompt", "16",
    "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "32", "--sglang-mem-fraction-static", "0.7",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "32",
    "--sglang-enable-dp-lm-head", "--sglang-cuda-graph-bs", "1", "2", "4", "8",
    *[str(n) for n in range(16, 257, 8)], "--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip


def test_qwen3_235b_plans_with_its_engines_across_nodes(tmp_path: Path) -> None:
    argv = with_local_paths(QWEN3_235B_A22B, "qwen3-235B-A22B", tmp_path)
    cfg = resolve(argv)
    check_hooks(cfg.rollout)
    plan = plan_from_config(cfg.cluster, False, False, eight_gpu_nodes(16), lambda _: None)
    actor = plan.train_group("actor")
    assert actor is not None and actor.world_size == 64 and actor.nnodes == 8
    assert cfg.megatron.data_parallel_size(64) == 2  # TP 4 x PP 4 x CP 2; experts EP 16 x ETP 1 x PP 4
    assert len(plan.engines) == 2
    for engine in plan.engines:  # slime's rule: an engine of 32 GPUs spans four 8-GPU nodes, no flag
        assert engine.tp_size == 32 and engine.nnodes == 4
        assert [part.node_rank for part in engine.parts] == [0, 1, 2, 3]
        assert engine.launch_args(engine.parts[3])[-4:] == ["--nnodes", "4", "--node-rank", "3"]
        assert engine.dist_init_addr is not None
    assert not cfg.cluster.rollout_engines_may_span_nodes


def test_the_fully_async_example_runs_as_the_fully_async_loop(tmp_path: Path, search_hooks: None) -> None:
    cfg, _ = plan_for(with_local_paths(QWEN25_05B_FULLY_ASYNC, "qwen2.5-0.5B", tmp_path))
    assert cfg.run.loop == "fully-async"


def test_the_mimo_eagle_script_trains_the_mtp_layer(tmp_path: Path) -> None:
    cfg, _ = plan_for(with_local_paths(MIMO_7B_EAGLE, "mimo-7B", tmp_path))
    m = cfg.megatron
    assert (m.mtp_num_layers, m.enable_mtp_training, m.mtp_loss_scaling_factor) == (1, True, 0.2)
    # The same flags against a checkpoint without MTP layers are refused before anything starts.
    argv = with_local_paths(MIMO_7B_EAGLE, "mimo-7B", tmp_path)
    hf = Path(argv[argv.index("--hf-checkpoint") + 1])
    (hf / "config.json").write_text(json.dumps({**HF_CONFIGS["mimo-7B"], "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="--mtp-num-layers"):
        plan_for(argv)


def test_the_sft_script_counts_its_epochs_at_start(tmp_path: Path) -> None:
    # --num-epoch 3 and a cosine schedule, no --num-rollout: `tether plan` accepts it and says the
    # horizon is counted from the prompts when the run starts; the run counts it before the trainer.
    cfg, _ = plan_for(with_local_paths(QWEN3_4B_BASE_SFT, "qwen3-4B", tmp_path))
    assert cfg.data.num_rollout is None and cfg.megatron.train_iters is None
    note = horizon_note(cfg)
    assert note is not None and "--num-epoch 3" in note
    # 1000 prompts in batches of 128: 7 rollouts an epoch, 21 in all, one optimizer step each.
    counted = with_counted_epochs(cfg, 1000)
    assert (counted.data.num_rollout, counted.megatron.train_iters) == (21, 21)
    kwargs = megatron_args.scheduler_kwargs(counted.megatron, counted.algorithm)
    assert kwargs["lr_decay_steps"] == 21 and kwargs["lr_warmup_steps"] == pytest.approx(2.1)
    assert (kwargs["lr_decay_style"], kwargs["min_lr"], kwargs["max_lr"]) == ("cosine", 1e-6, 1e-5)


# slime: scripts/run-minimax-m2.sh (MODEL_ARGS: scripts/models/minimax-m2.sh), MiniMax-M2.5 as its
# model flags describe it (the config.json MiniMax publishes: rotary_dim, sigmoid routing with a
# correction bias, QK norms over all heads).
HF_CONFIGS["minimax-m2.5"] = {
    "model_type": "minimax_m2",
    "vocab_size": 200064,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "num_hidden_layers": 62,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "tie_word_embeddings": False,
    "max_position_embeddings": 196608,
}
MINIMAX_M2_MODEL_ARGS = [
    "--spec", "slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec", "--disable-bias-linear",
    "--num-layers", "62", "--hidden-size", "3072", "--ffn-hidden-size", "1536",
    "--num-attention-heads", "48", "--kv-channels", "128", "--num-query-groups", "8",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
    "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "200064",
    "--group-query-attention", "--rotary-percent", "0.5", "--rotary-base", "5000000",
    "--qk-layernorm", "--no-rope-fusion", "--attention-softmax-in-fp32",
    "--num-experts", "256", "--moe-ffn-hidden-size", "1536", "--moe-router-topk", "8",
    "--moe-layer-freq", "[1]*62", "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "none",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0",
    "--moe-grouped-gemm", "--moe-permute-fusion",
]  # fmt: skip


def _minimax_argv(tmp: Path, model_args: list[str]) -> list[str]:
    """MiniMax-M2's MODEL_ARGS on one 8-GPU node (its script as written, PP 2 under --colocate on two
    nodes: MULTI_NODE_SCRIPTS)."""
    return with_local_paths(
        [
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
            *model_args,
            "--hf-checkpoint", "/root/MiniMax-M2.5", "--model-name", "minimax_m2", "--prompt-data", "/root/dapo.jsonl",
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "deepscaler",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
            "--rollout-num-gpus-per-engine", "8",
        ],
        "minimax-m2.5",
        tmp,
    )  # fmt: skip


def test_minimax_m2_model_args_plan_against_its_config(tmp_path: Path) -> None:
    cfg, plan = plan_for(_minimax_argv(tmp_path, MINIMAX_M2_MODEL_ARGS))
    assert cfg.megatron.spec == ["slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"]
    assert cfg.megatron.model_name == "minimax_m2"
    assert plan.train_group("actor") is not None
    # A flag that disagrees with the checkpoint is refused, naming it.
    wrong = [*MINIMAX_M2_MODEL_ARGS]
    wrong[wrong.index("--rotary-percent") + 1] = "1.0"
    with pytest.raises(ConfigError, match="--rotary-percent"):
        plan_for(_minimax_argv(tmp_path / "wrong", wrong))
    # --model-name picks slime's converter: a name of another family is refused.
    named = _minimax_argv(tmp_path / "named", MINIMAX_M2_MODEL_ARGS)
    named[named.index("--model-name") + 1] = "qwen3"
    with pytest.raises(ConfigError, match="--model-name"):
        plan_for(named)
    # Its spec names MiniMax-M2's layers: refused for any other checkpoint.
    argv = _minimax_argv(tmp_path / "qwen", MINIMAX_M2_MODEL_ARGS)
    at = argv.index("--model-name")
    del argv[at : at + 2]
    hf = Path(argv[argv.index("--hf-checkpoint") + 1])
    (hf / "config.json").write_text(json.dumps({**HF_CONFIGS["minimax-m2.5"], "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match="--spec"):
        plan_for(argv)


# --- slime's multi-node scripts: each placed on as many 8-GPU nodes as it asks for -----------------


# The MODEL_ARGS of scripts/models/qwen3-235B-A22B.sh, as run-qwen3-235B-A22B.sh passes them.
QWEN3_235B_A22B_MODEL_ARGS = QWEN3_235B_A22B[
    QWEN3_235B_A22B.index("--disable-bias-linear") : QWEN3_235B_A22B.index("--hf-checkpoint")
]

# slime: scripts/low_precision/run-qwen3-235B-A22B-int4.sh (MODEL_ARGS: scripts/models/qwen3-235B-A22B.sh):
# 8 colocated nodes with run-qwen3-235B-A22B.sh's trainer layout, engines of 8 GPUs (no DP attention),
# an INT4 checkpoint trained with fake INT4 quantization (OPEN_TRAINING_INT4_GROUP_SIZE=128).
QWEN3_235B_A22B_INT4 = [
    "--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    *QWEN3_235B_A22B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-235B-A22B-INT4/", "--ref-load", "/root/Qwen3-235B-A22B_torch_dist/",
    "--load", "/root/Qwen3-235B-A22B-slime/", "--save", "/root/Qwen3-235B-A22B-slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "300", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "0.8", "--global-batch-size", "256",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28", "--use-tis",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--context-parallel-size", "2", "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "22",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-interval", "10", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "8",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 257, 8)],
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--no-check-for-nan-in-loss-and-grad",
]  # fmt: skip

# slime: scripts/run-qwen3-235B-A22B-sft.sh (MODEL_ARGS: scripts/models/qwen3-235B-A22B.sh), launched
# with train_async.py on 4 nodes (TP 4, experts over EP 32), the trainer only; BASE_FOLDER=/root (the
# script requires it set); its EVAL_ARGS is never set (empty).
QWEN3_235B_A22B_SFT = [
    "--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8",
    # MODEL_ARGS
    *QWEN3_235B_A22B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-235B-A22B", "--ref-load", "/root/Qwen3-235B-A22B_torch_dist",
    "--load", "/root/Qwen3-235B-A22B_slime/", "--save", "/root/Qwen3-235B-A22B_slime/",
    "--save-interval", "1000",
    # SFT_ARGS
    "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
    "--prompt-data", "/root/openhermes2_5.parquet", "--input-key", "messages", "--rollout-shuffle",
    "--num-epoch", "3", "--rollout-batch-size", "128", "--global-batch-size", "128",
    "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
    "--debug-train-only",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
    "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-deepseek-r1.sh (MODEL_ARGS: scripts/models/deepseek-v3.sh, its
# MODEL_ARGS_NUM_LAYERS unset: 61 layers): 16 colocated nodes (TP 8, PP 4, CP 4, experts at ETP 1
# over EP 32), engines of 64 GPUs (8 nodes each) with DP attention, DeepEP and the MTP layer as
# EAGLE draft. $BASE_DIR comes from the environment: /root here.
HF_CONFIGS["deepseek-r1"] = {  # deepseek-ai/DeepSeek-R1's config.json (DeepSeek-V3's architecture)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
DEEPSEEK_R1 = [
    "--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS (MOE_LAYER_FREQ as the model file's printf writes it: [0,0,0,1,...,1])
    "--disable-bias-linear", "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "128", "--kv-channels", "128", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--swiglu",
    "--untie-embeddings-and-output-weights", "--vocab-size", "129280",
    "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm", "--rotary-scaling-factor", "40",
    "--rotary-base", "10000", "--mscale", "1.0", "--mscale-all-dim", "1.0", "--attention-softmax-in-fp32",
    "--no-rope-fusion",
    "--num-experts", "256", "--moe-layer-freq", "[" + ",".join(["0"] * 3 + ["1"] * 58) + "]",
    "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "2048",
    "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0", "--moe-router-group-topk", "4",
    "--moe-router-num-groups", "8", "--moe-grouped-gemm", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/DeepSeek-R1/", "--ref-load", "/root/DeepSeek-R1_torch_dist/",
    "--load", "/root/DeepSeek-R1_slime/", "--save", "/root/DeepSeek-R1_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--context-parallel-size", "4", "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "13",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/rl_data/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "64", "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "64",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-moe-dense-tp-size", "1",
    "--sglang-enable-dp-lm-head", "--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-server-concurrency", "1024",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-enable-deepep", "--moe-token-dispatcher-type", "flex",
]  # fmt: skip

# slime: scripts/run-glm4.7-355B-A32B.sh (MODEL_ARGS: scripts/models/glm4.5-355B-A32B.sh): GLM-4.7 on 8
# colocated nodes (ACTOR_NUM_NODES and ACTOR_NUM_GPUS_PER_NODE at their defaults, 8 and 8; TP 8, PP 4,
# CP 2, experts at ETP 1 over EP 16), engines of 32 GPUs with DP attention and the MTP layer as EAGLE
# draft, Megatron's experts dispatched by DeepEP; $BASE_DIR from the environment: /root here.
HF_CONFIGS["glm4.7-355B-A32B"] = {  # zai-org/GLM-4.7's config.json
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 3,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_qk_norm": True,
    "vocab_size": 151552,
}
GLM47_355B_A32B = [
    "--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "96",
    "--num-query-groups", "8", "--kv-channels", "128", "--num-layers", str(3 + 89), "--hidden-size", "5120",
    "--ffn-hidden-size", "12288", "--add-qkv-bias", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--swiglu",
    "--untie-embeddings-and-output-weights", "--vocab-size", "151552", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "1536", "--moe-shared-expert-intermediate-size", "1536",
    "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0]*3+[1]*89", "--num-experts", "160",
    "--moe-grouped-gemm", "--moe-router-dtype", "fp32", "--moe-permute-fusion", "--moe-aux-loss-coeff", "0",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/GLM-4.7-355B-A32B", "--ref-load", "/root/GLM-4.7-355B-A32B_torch_dist/",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data", "--rollout-stop-token-ids", "151329", "151336", "151338",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "1e-4", "--eps-clip-high", "2e-4",
    "--use-tis",
    # PERF_ARGS
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--context-parallel-size", "2", "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/rl_data/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "32", "--sglang-mem-fraction-static", "0.7",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "32",
    "--sglang-enable-dp-lm-head", "--sglang-moe-dense-tp-size", "1",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
]  # fmt: skip

# slime: scripts/run-kimi-k2-Thinking.sh (MODEL_ARGS: scripts/models/kimi-k2-thinking.sh): 32 colocated
# nodes (TP 8, PP 8, CP 4, experts at ETP 1 over EP 32), engines of 16 GPUs (2 nodes each) with DP
# attention; $BASE_DIR from the environment: /root here.
HF_CONFIGS["kimi-k2-thinking"] = {  # moonshotai/Kimi-K2-Thinking's config.json, in BF16
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 163840,
}
KIMI_K2_THINKING = [
    "--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--colocate",
    "--update-weight-buffer-size", str(4 * 512 * 1024 * 1024),
    # MODEL_ARGS (MOE_LAYER_FREQ as the model file's printf writes it: [0,1,...,1])
    "--disable-bias-linear", "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "64", "--kv-channels", "64", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--norm-epsilon", "1e-5", "--swiglu",
    "--untie-embeddings-and-output-weights", "--vocab-size", "163840",
    "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm",
    "--rotary-scaling-factor", "64.0", "--rotary-base", "50000", "--mscale", "1.0", "--mscale-all-dim", "1.0",
    "--attention-softmax-in-fp32", "--no-rope-fusion",
    "--num-experts", "384", "--moe-layer-freq", "[" + ",".join(["0"] * 1 + ["1"] * 60) + "]",
    "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "2048",
    "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0", "--moe-router-group-topk", "1",
    "--moe-router-num-groups", "1", "--moe-grouped-gemm", "--moe-router-topk-scaling-factor", "2.827",
    "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    # CKPT_ARGS (the BF16 checkpoint's line is commented out: the script serves an FP8 one)
    "--hf-checkpoint", "/root/Kimi-K2-Thinking-fp8/", "--ref-load", "/root/Kimi-K2-Thinking_torch_dist/",
    "--load", "/root/Kimi-K2-Thinking_slime/", "--save", "/root/Kimi-K2-Thinking_slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
    "--num-rollout", "100", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "16384", "--rollout-temperature", "1",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28", "--use-tis",
    # PERF_ARGS
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "8",
    "--context-parallel-size", "4", "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "5",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "16", "--sglang-mem-fraction-static", "0.7",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-moe-dense-tp-size", "1",
    "--sglang-enable-dp-lm-head", "--sglang-ep-size", "16", "--sglang-server-concurrency", "1024",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/low_precision/run-kimi-k2-Thinking-int4.sh (MODEL_ARGS: scripts/models/kimi-k2-thinking.sh):
# run-kimi-k2-Thinking.sh's trainer on Kimi-K2-Thinking's own INT4 checkpoint, engines of 8 GPUs without
# DP attention, fake INT4 quantization at OPEN_TRAINING_INT4_GROUP_SIZE=32.
KIMI_K2_THINKING_INT4 = [
    *KIMI_K2_THINKING[: KIMI_K2_THINKING.index("--hf-checkpoint")],  # its cluster flags and MODEL_ARGS
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Kimi-K2-Thinking/", "--ref-load", "/root/Kimi-K2_thinking_torch_dist/",
    "--load", "/root/Kimi-K2-thinking_slime/", "--save", "/root/Kimi-K2-thinking_slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
    "--num-rollout", "100", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "16384", "--rollout-temperature", "0.8",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28", "--use-tis",
    # PERF_ARGS
    "--tensor-model-parallel-size", "8", "--sequence-parallel", "--pipeline-model-parallel-size", "8",
    "--context-parallel-size", "4", "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
    "--decoder-last-pipeline-num-layers", "5",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    # EVAL_ARGS
    "--eval-interval", "10", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "8",
    "--sglang-server-concurrency", "1024",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--no-check-for-nan-in-loss-and-grad",
]  # fmt: skip

# slime: scripts/run-minimax-m2.sh (MODEL_ARGS: scripts/models/minimax-m2.sh) as written: 16 colocated
# nodes (TP 2, PP 2, experts at ETP 1 over EP 4), engines of 16 GPUs (2 nodes each); BASE_DIR at its
# default, /root.
MINIMAX_M2 = [
    "--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    *MINIMAX_M2_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/MiniMax-M2.5", "--ref-load", "/root/MiniMax-M2.5_torch_dist",
    "--load", "/root/MiniMax-M2.5_slime/", "--save", "/root/MiniMax-M2.5_slime/", "--save-interval", "20",
    "--model-name", "minimax_m2",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1",
    "--over-sampling-batch-size", "256",
    "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    "--num-steps-per-rollout", "4", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
    "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    "--eps-clip-high", "0.28",
    # TB_ARGS
    "--use-tensorboard",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/rl_data/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "16", "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "16",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen3.5-27B.sh (MODEL_ARGS: scripts/models/qwen3.5-27B.sh) at its defaults: 4
# colocated nodes (ACTOR_NUM_NODES=4; TP 4, PP 2, CP_SIZE=4), engines of 2 GPUs serving the checkpoint's
# MTP layer as the EAGLE draft; BASE_FOLDER=/root (the script requires it set); its WANDB_ARGS are
# commented out (empty).
QWEN35_27B = [
    "--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec",
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "24",
    "--num-query-groups", "4", "--kv-channels", "256", "--num-layers", "64", "--hidden-size", "5120",
    "--ffn-hidden-size", "17408", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "248320", "--rotary-base", "10000000", "--attention-output-gate",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3.5-27B", "--ref-load", "/root/Qwen3.5-27B_torch_dist/",
    "--load", "/root/Qwen3.5-27B_slime/", "--save", "/root/Qwen3.5-27B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1.0", "--global-batch-size", "64",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
    "--decoder-last-pipeline-num-layers", "30", "--context-parallel-size", "4",
    "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--calculate-per-token-loss", "--max-tokens-per-gpu", "8192",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.75",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-mamba-scheduler-strategy", "extra_buffer",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
]  # fmt: skip

# slime: scripts/run-qwen3-next-80B-A3B.sh (MODEL_ARGS: scripts/models/qwen3-next-80B-A3B.sh, its
# MOE_LAYER_FREQ [1,...,1]) at its defaults: 4 colocated nodes (ACTOR_NUM_NODES=4; TP 2, PP 4,
# CP_SIZE=4, experts at ETP 1 over EP 8, dispatched by DeepEP), engines of 8 GPUs serving the MTP layer
# as the EAGLE draft; BASE_FOLDER=/root (the script requires it set); its WANDB_ARGS are commented out.
HF_CONFIGS["qwen3-next-80B-A3B"] = {  # Qwen/Qwen3-Next-80B-A3B-Thinking's config.json
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_NEXT_80B_A3B = [
    "--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8", "--colocate",
    # MODEL_ARGS
    "--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec",
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "16",
    "--num-query-groups", "2", "--kv-channels", "256", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "5120", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "10000000",
    # moe
    "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "512",
    "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "10",
    "--moe-layer-freq", "[" + ",".join(["1"] * 48) + "]", "--num-experts", "512", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
    # qwen3 specific
    "--attention-output-gate", "--moe-shared-expert-gate",
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-Next-80B-A3B-Thinking",
    "--ref-load", "/root/Qwen3-Next-80B-A3B-Thinking_torch_dist",
    "--load", "/root/Qwen3-Next-80B-A3B-Thinking_slime/", "--save", "/root/Qwen3-Next-80B-A3B-Thinking_slime/",
    "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1", "--global-batch-size", "64",
    "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "4e-4",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--decoder-last-pipeline-num-layers", "9", "--context-parallel-size", "4",
    "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.8", "--sglang-ep-size", "8",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(n) for n in range(16, 129, 8)],
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-max-running-requests", "256",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
]  # fmt: skip

# slime: examples/coding_agent_rl/run_qwen36_35b_a3b_swe_8nodes.sh (its MODEL_ARGS inline:
# scripts/models/qwen3.5-35B-A3B.sh's) at its defaults: 8 colocated nodes (ACTOR_NUM_NODES from
# MLP_WORKER_NUM unset: 8; TP 2, CP 8, experts at ETP 1 over EP 8, dispatched by DeepEP), 64 rollout
# GPUs in engines of 8 with DP attention, prompts of MAX_CONTEXT_LEN=96000 tokens, 12000 a CP rank
# (--max-tokens-per-gpu $((MAX_CONTEXT_LEN / CP_SIZE))). Its generate hook lives in the example's
# generate.py, which the test stands in for (the SWE_*/ADAPTER_*/E2B_* environment it exports is read
# by that hook at rollout time, not by train.py). RUN_ROOT is ${SLIME_DIR}/runs/agent_only_<date>.
QWEN36_35B_A3B_SWE = [
    "--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8",
    # MODEL_ARGS
    *QWEN35_35B_A3B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/path/to/Qwen3.6-35B-A3B", "--ref-load", "/path/to/Qwen3.6-35B-A3B_torch_dist",
    # ROLLOUT_ARGS
    "--custom-generate-function-path", "examples.coding_agent_rl.generate.generate",
    "--prompt-data", "/path/to/swe_train.jsonl", "--input-key", "prompt", "--label-key", "label",
    "--metadata-key", "metadata", "--num-rollout", "100", "--rollout-batch-size", "8",
    "--n-samples-per-prompt", "8", "--rollout-max-context-len", "96000", "--rollout-max-response-len", "32768",
    "--rollout-temperature", "1.0", "--rollout-stop-token-ids", "248046", "248044",
    "--num-steps-per-rollout", "1", "--global-batch-size", "64", "--micro-batch-size", "1",
    "--save-debug-rollout-data", "/root/slime/runs/agent_only_20260101_000000/rollout_dumps/rollout_{rollout_id}.pt",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # ALGO_ARGS
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "8", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--max-tokens-per-gpu", str(96000 // 8), "--log-probs-chunk-size", "1024", "--use-dynamic-batch-size",
    # SGLANG_ARGS
    "--rollout-num-gpus", "64", "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.75",
    "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-ep-size", "8",
    "--sglang-enable-dp-lm-head", "--sglang-moe-dense-tp-size", "1",
    "--sglang-tool-call-parser", "qwen3_coder", "--sglang-reasoning-parser", "qwen3",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash",
    "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep", "--colocate",
]  # fmt: skip

HF_CONFIGS["glm5-744B-A40B"] = {  # zai-org/GLM-5's config.json (transformers' GlmMoeDsaConfig)
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": [154820, 154827, 154829],
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 2048,
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 78,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 154820,
    "q_lora_rank": 2048,
    "qk_head_dim": 256,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "v_head_dim": 256,
    "vocab_size": 154880,
}


def glm5_model_args(rotary_base: str) -> list[str]:
    """MODEL_ARGS of slime's scripts/models/glm5-744B-A40B.sh; glm5.2-744B-A40B.sh differs only in
    its --rotary-base."""
    return [
        "--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec",
        "--moe-layer-freq", "[0]*3+[1]*75", "--num-experts", "256", "--moe-shared-expert-intermediate-size",
        "2048", "--moe-router-topk", "8", "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-ffn-hidden-size",
        "2048", "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32", "--make-vocab-size-divisible-by", "16",
        "--num-layers", "78", "--hidden-size", "6144", "--ffn-hidden-size", "12288",
        "--num-attention-heads", "64", "--disable-bias-linear", "--swiglu",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--no-position-embedding",
        "--normalization", "RMSNorm", "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "2048",
        "--kv-lora-rank", "512", "--qk-head-dim", "192", "--v-head-dim", "256", "--kv-channels", "192",
        "--qk-pos-emb-head-dim", "64", "--vocab-size", "154880", "--rotary-base", rotary_base,
        "--enable-experimental", "--allgather-cp",
    ]  # fmt: skip


# slime: scripts/run-glm5-744B-A40B.sh (MODEL_ARGS: scripts/models/glm5-744B-A40B.sh) as written: 32
# colocated nodes (TP 4 with SP, PP 4 with 18 layers last, CP 2 in slime's all-gather layout, experts
# at ETP 1 over EP 32, dispatched by DeepEP), engines of 64 GPUs with DP attention and DeepEP, MTP as
# the EAGLE draft, the DSA attention backend; its WANDB_ARGS and EVAL_ARGS are empty.
GLM5_744B_A40B = [
    "--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--colocate",
    "--update-weight-buffer-size", str(1024 * 1024 * 1024 * 2),
    # MODEL_ARGS
    *glm5_model_args("1000000"),
    # CKPT_ARGS
    "--hf-checkpoint", "/root/GLM-5", "--ref-load", "/root/GLM-5_torch_dist/", "--load", "/root/GLM-5_slime/",
    "--save", "/root/GLM-5_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "32768", "--rollout-temperature", "1", "--global-batch-size", "64",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
    "--decoder-last-pipeline-num-layers", "18", "--expert-model-parallel-size", "32",
    "--expert-tensor-parallel-size", "1", "--context-parallel-size", "2",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384", "--data-pad-size-multiplier", "4096",
    "--log-probs-chunk-size", "1024",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "64", "--sglang-mem-fraction-static", "0.70",
    "--sglang-enable-dp-attention", "--sglang-ep-size", "64", "--sglang-dp-size", "64",
    "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head", "--sglang-moe-a2a-backend", "deepep",
    "--sglang-deepep-mode", "auto", "--prefill-num-servers", "1",
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
    "--sglang-page-size", "64", "--sglang-nsa-decode-backend", "flashmla_sparse",
    "--sglang-nsa-prefill-backend", "flashmla_sparse", "--sglang-attention-backend", "nsa",
    "--sglang-cuda-graph-max-bs", "8", "--sglang-max-running-requests", "512",
    "--sglang-chunked-prefill-size", "131072", "--sglang-watchdog-timeout", "3600",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--moe-enable-deepep",
    "--moe-token-dispatcher-type", "flex",
]  # fmt: skip

# zai-org/GLM-5.2's config.json was not found to copy; this is GLM-5's with what slime's recipe says
# differs: scripts/models/glm5.2-744B-A40B.sh changes only --rotary-base (8000000) from GLM-5's
# MODEL_ARGS (the same 78 layers, 3 dense, widths, MLA and experts), and its comments, the script's and
# docs/en/examples/glm5.2-744B-A40B.md give the indexer's cross-layer sharing schedule that
# get_glm5_spec reads from the config: index_topk_freq 4, index_skip_topk_offset 3 (computing layers
# 1, 2, 3, 7, 11, ..., 75, 1-based; the others reuse the last computing layer's top-k).
HF_CONFIGS["glm5.2-744B-A40B"] = {
    **HF_CONFIGS["glm5-744B-A40B"],
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
}

# What run-glm5.2-744B-A40B.sh writes to its mktemp file and passes as --sglang-config: one 64-GPU
# prefill engine and three 64-GPU decode engines, each group with its SGLang overrides.
GLM52_SGLANG_CONFIG_FILE = "/tmp/sglang_glm52_744B_A40B_XXXXXX.yaml"
SGLANG_CONFIGS[GLM52_SGLANG_CONFIG_FILE] = textwrap.dedent(
    """\
    sglang:
      - name: default
        server_groups:
          - worker_type: prefill
            num_gpus: 64
            num_gpus_per_engine: 64
            overrides:
              dp_size: 64
              ep_size: 64
              enable_dp_attention: true
              enable_dp_lm_head: true
              moe_dense_tp_size: 1
              load_balance_method: follow_bootstrap_room
              chunked_prefill_size: 131072
              max_running_requests: 512
              deepep_mode: auto
          - worker_type: decode
            num_gpus: 192
            num_gpus_per_engine: 64
            overrides:
              dp_size: 64
              ep_size: 64
              enable_dp_attention: true
              enable_dp_lm_head: true
              moe_dense_tp_size: 1
              load_balance_method: round_robin
              max_running_requests: 768
              cuda_graph_max_bs: 12
              deepep_mode: low_latency
              moe_runner_backend: deep_gemm
              disable_overlap_schedule: true
    """
)

# slime: scripts/run-glm5.2-744B-A40B.sh (MODEL_ARGS: scripts/models/glm5.2-744B-A40B.sh) as written: 32
# colocated nodes (TP 4 with SP, PP 8 split 14 / 6 x 8 / 16 so every stage starts on a layer that
# computes its sparse-attention top-k, CP 8 in slime's all-gather layout, experts at ETP 1 over EP 32
# with the all-to-all dispatcher), GRPO with TIS, engines of 64 GPUs from --sglang-config (prefill and
# decode groups, PD transfer over mooncake), FP8 KV cache, MTP as the EAGLE draft; its WANDB_ARGS are
# empty. $BASE_DIR comes from the environment: /root here. Its --hf-checkpoint is GLM-5.2-FP8 (SGLang
# serves FP8 weights, Megatron trains the BF16 torch_dist one): planned here against the unquantized
# config, refused against the FP8 one (QUANTIZED below).
GLM52_744B_A40B = [
    "--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--colocate",
    "--no-check-for-nan-in-loss-and-grad", "--update-weight-buffer-size", str(1024 * 1024 * 1024 * 2),
    # MODEL_ARGS
    *glm5_model_args("8000000"),
    # CKPT_ARGS
    "--hf-checkpoint", "/root/GLM-5.2-FP8", "--ref-load", "/root/GLM-5.2_torch_dist",
    "--load", "/root/GLM-5.2_slime", "--save", "/root/GLM-5.2_slime", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
    "--num-rollout", "3000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "65536", "--rollout-temperature", "1.0", "--global-batch-size", "64",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--use-tis", "--tis-clip-low", "0.5", "--tis-clip", "2.0",
    # PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "8",
    "--decoder-first-pipeline-num-layers", "14", "--decoder-last-pipeline-num-layers", "16",
    "--context-parallel-size", "8", "--expert-model-parallel-size", "32",
    "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--data-pad-size-multiplier", "1024",
    "--log-probs-chunk-size", "16384",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "64", "--sglang-mem-fraction-static", "0.70",
    "--sglang-enable-dp-attention", "--sglang-ep-size", "64", "--sglang-dp-size", "64",
    "--sglang-moe-dense-tp-size", "1", "--sglang-enable-dp-lm-head", "--sglang-moe-a2a-backend", "deepep",
    "--sglang-deepep-mode", "auto", "--sglang-page-size", "64", "--sglang-kv-cache-dtype", "fp8_e4m3",
    "--sglang-nsa-decode-backend", "flashmla_kv", "--sglang-nsa-prefill-backend", "flashmla_sparse",
    "--sglang-attention-backend", "nsa", "--sglang-cuda-graph-max-bs", "8",
    "--sglang-disable-overlap-schedule", "--sglang-max-running-requests", "512",
    "--sglang-watchdog-timeout", "3600", "--sglang-disaggregation-transfer-backend", "mooncake",
    "--sglang-disaggregation-ib-device",
    "mlx5_100,mlx5_101,mlx5_102,mlx5_103,mlx5_104,mlx5_105,mlx5_106,mlx5_107",
    "--sglang-config", GLM52_SGLANG_CONFIG_FILE,
    "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "4",
    "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "5",
    "--sglang-speculative-draft-attention-backend", "nsa",
    # MISC_ARGS
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--moe-token-dispatcher-type", "alltoall",
]  # fmt: skip

# script path in slime -> (its arguments, the model its MODEL_ARGS describe, the 8-GPU nodes it needs)
MULTI_NODE_SCRIPTS: dict[str, tuple[list[str], str, int]] = {
    "scripts/run-qwen3-235B-A22B.sh": (QWEN3_235B_A22B, "qwen3-235B-A22B", 16),
    "scripts/run-qwen3-235B-A22B-sft.sh": (QWEN3_235B_A22B_SFT, "qwen3-235B-A22B", 4),
    "scripts/low_precision/run-qwen3-235B-A22B-int4.sh": (QWEN3_235B_A22B_INT4, "qwen3-235B-A22B", 8),
    "scripts/run-deepseek-r1.sh": (DEEPSEEK_R1, "deepseek-r1", 16),
    "scripts/run-glm4.7-355B-A32B.sh": (GLM47_355B_A32B, "glm4.7-355B-A32B", 8),
    "scripts/run-kimi-k2-Thinking.sh": (KIMI_K2_THINKING, "kimi-k2-thinking", 32),
    "scripts/low_precision/run-kimi-k2-Thinking-int4.sh": (KIMI_K2_THINKING_INT4, "kimi-k2-thinking", 32),
    "scripts/run-minimax-m2.sh": (MINIMAX_M2, "minimax-m2.5", 16),
    "scripts/run-qwen3.5-27B.sh": (QWEN35_27B, "qwen3.5-27B", 4),
    "scripts/run-qwen3-next-80B-A3B.sh": (QWEN3_NEXT_80B_A3B, "qwen3-next-80B-A3B", 4),
    "scripts/run-glm5-744B-A40B.sh": (GLM5_744B_A40B, "glm5-744B-A40B", 32),
    "scripts/run-glm5.2-744B-A40B.sh": (GLM52_744B_A40B, "glm5.2-744B-A40B", 32),
    "examples/coding_agent_rl/run_qwen36_35b_a3b_swe_8nodes.sh": (QWEN36_35B_A3B_SWE, "qwen3.6-35B-A3B", 8),
}


@pytest.mark.parametrize("script", sorted(MULTI_NODE_SCRIPTS))
def test_multi_node_slime_script_plans_unchanged(script: str, tmp_path: Path, example_hooks: None) -> None:
    """Each script on as many 8-GPU nodes as it asks for, as written. Those that train with pipeline
    parallelism under --colocate plan too: every stage's weights reach every trainer rank before the
    colocated update (tether.train.checkpoint.export.iter_every_stage), as slime broadcasts them over
    the PP group (slime/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py)."""
    argv, model, nodes = MULTI_NODE_SCRIPTS[script]
    local = with_local_paths(argv, model, tmp_path)
    cfg, plan = plan_for(local, eight_gpu_nodes(nodes))
    actor = plan.train_group("actor")
    assert actor is not None
    actor_nodes, per_node = (
        int(_flag(argv, "--actor-num-nodes")),
        int(_flag(argv, "--actor-num-gpus-per-node")),
    )
    assert (actor.world_size, actor.nnodes) == (actor_nodes * per_node, actor_nodes)
    if "--debug-train-only" in argv:
        assert cfg.debug.debug_train_only and not plan.engines
    else:
        per_engine = int(_flag(argv, "--rollout-num-gpus-per-engine"))
        rollout_gpus = (
            actor_nodes * per_node if "--colocate" in argv else int(_flag(argv, "--rollout-num-gpus"))
        )
        assert len(plan.engines) == rollout_gpus // per_engine
        for engine in plan.engines:  # an engine wider than a node spans nodes, as slime places it
            assert engine.tp_size == per_engine and engine.nnodes == -(-per_engine // 8)
    assert plan.colocate is cfg.cluster.colocate is ("--colocate" in argv)
    assert cfg.data.rollout_shuffle is ("--rollout-shuffle" in argv)  # the coding agent's keeps its order
    assert Config.from_json(cfg.to_json()) == cfg
    assert msgspec.json.decode(plan.to_json())["mode"] == plan.mode


def test_the_qwen3_next_and_qwen3_5_moe_scripts_train_with_context_parallelism(
    tmp_path: Path, example_hooks: None
) -> None:
    """slime's Qwen3-Next and Qwen3.5-MoE scripts (run-qwen3-next-80B-A3B.sh, run-qwen3.5-35B-A3B-sft.sh,
    the coding agent's run_qwen36_35b_a3b_swe_8nodes.sh) pass --moe-shared-expert-gate, checked against the
    checkpoint's shared-expert gate, and train their gated-DeltaNet layers with context parallelism where
    the script asks for it (CP 4, CP 8)."""
    tables = {**{s: (*row, 1) for s, row in SCRIPTS.items()}, **MULTI_NODE_SCRIPTS}
    gated = {s: row for s, row in tables.items() if "--moe-shared-expert-gate" in row[0]}
    assert sorted(gated) == [
        "examples/coding_agent_rl/run_qwen36_35b_a3b_swe_8nodes.sh",
        "scripts/run-qwen3-next-80B-A3B.sh",
        "scripts/run-qwen3.5-35B-A3B-sft.sh",
    ]
    for script, (argv, model, nodes) in gated.items():
        local = with_local_paths(argv, model, tmp_path / Path(script).stem)
        cfg, plan = plan_for(local, eight_gpu_nodes(nodes))
        assert cfg.megatron.moe_shared_expert_gate
        assert cfg.megatron.context_parallel_size == int(_flag(argv, "--context-parallel-size"))
        assert (cfg.megatron.moe_token_dispatcher_type, cfg.megatron.moe_enable_deepep) == ("flex", True)
        actor = plan.train_group("actor")
        assert actor is not None and actor.world_size == 8 * nodes
        # colocated engines of 8 GPUs, one a node; the SFT script's trainer alone
        assert len(plan.engines) == (0 if "--debug-train-only" in argv else nodes)


def test_qwen3_5_trains_with_context_parallelism_and_either_gdn_backend(tmp_path: Path) -> None:
    """slime's run-qwen3.5-27B.sh trains Qwen3.5's gated-DeltaNet layers at CP 4 (under TP 4, PP 2) with
    slime's default gated delta rule (fla). --qwen-gdn-backend flashqla, slime's other kernel, plans too
    and is checked on each trainer rank: refused where FlashQLA is not installed, and on CPU ranks."""
    argv = with_local_paths(QWEN35_27B, "qwen3.5-27B", tmp_path)
    cfg, _ = plan_for(argv, eight_gpu_nodes(4))
    m = cfg.megatron
    assert (m.context_parallel_size, m.qwen_gdn_backend) == (4, "fla")
    assert m.spec == ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    cfg, _ = plan_for([*argv, "--qwen-gdn-backend", "flashqla"], eight_gpu_nodes(4))
    check_capabilities(cfg.megatron, Capabilities.full_gpu())
    without = dataclasses.replace(Capabilities.full_gpu(), flash_qla=False)
    with pytest.raises(ConfigError, match=r"--qwen-gdn-backend='flashqla': needs the flash_qla module"):
        check_capabilities(cfg.megatron, without)
    with pytest.raises(ConfigError, match=r"--qwen-gdn-backend='flashqla': needs CUDA"):
        check_capabilities(cfg.megatron, Capabilities.cpu())


def test_the_glm5_script_plans_sparse_attention_with_prefill_and_decode_engines(tmp_path: Path) -> None:
    """slime's run-glm5-744B-A40B.sh: GLM-5's sparse-attention layers (--spec ...glm5 get_glm5_spec,
    the model flags checked against its config), CP 2 in slime's all-gather layout, and
    --prefill-num-servers 1: one 64-GPU prefill engine, the other 192 rollout GPUs decode engines."""
    cfg, plan = plan_for(with_local_paths(GLM5_744B_A40B, "glm5-744B-A40B", tmp_path), eight_gpu_nodes(32))
    m = cfg.megatron
    assert (m.context_parallel_size, m.allgather_cp, m.enable_experimental) == (2, True, True)
    assert [(e.worker_type, e.tp_size, e.nnodes) for e in plan.engines] == [("prefill", 64, 8)] + [
        ("decode", 64, 8)
    ] * 3
    with pytest.raises(ConfigError, match=r"--prefill-num-servers=4: leaves no decode devices"):
        plan_for(
            _replaced(
                with_local_paths(GLM5_744B_A40B, "glm5-744B-A40B", tmp_path), {"--prefill-num-servers": "4"}
            ),
            eight_gpu_nodes(32),
        )


def test_the_glm52_script_splits_its_pipeline_where_stages_start_on_computing_layers(tmp_path: Path) -> None:
    """slime's run-glm5.2-744B-A40B.sh: GLM-5.2's indexer computes its top-k on layers 1, 2, 3, 7, 11,
    ..., 75 (1-based; index_topk_freq 4, index_skip_topk_offset 3) and the others reuse the last one's,
    which does not cross a pipeline stage (slime's get_glm5_spec asserts it). The script's PP 8 split,
    14 / 6 x 8 / 16, starts every stage on a computing layer and plans with CP 8 in the all-gather
    layout and TIS; a split starting a stage on a sharing layer is refused, naming that layer. Its
    --sglang-config groups become one prefill and three decode engines with their groups' overrides
    over the --sglang-* flags (the PD transfer backend and IB devices included)."""
    argv = with_local_paths(GLM52_744B_A40B, "glm5.2-744B-A40B", tmp_path)
    cfg, plan = plan_for(argv, eight_gpu_nodes(32))
    m = cfg.megatron
    sizes = stage_layers(
        78,
        m.pipeline_model_parallel_size,
        m.decoder_first_pipeline_num_layers,
        m.decoder_last_pipeline_num_layers,
        layers_flag="--num-layers",
    )
    assert sizes == [14, *[8] * 6, 16]
    arch = load_arch(_flag(argv, "--hf-checkpoint"))
    assert arch.index_shared is not None
    computing = [i + 1 for i, shared in enumerate(arch.index_shared) if not shared]
    assert computing[:5] == [1, 2, 3, 7, 11] and computing[-1] == 75 and len(computing) == 21
    starts = [sum(sizes[:stage]) + 1 for stage in range(len(sizes))]
    assert starts == [1, 15, 23, 31, 39, 47, 55, 63] and set(starts) <= set(computing)
    assert (m.context_parallel_size, m.allgather_cp, m.tensor_model_parallel_size) == (8, True, 4)
    assert (m.moe_token_dispatcher_type, m.no_check_for_nan_in_loss_and_grad) == ("alltoall", True)
    a = cfg.algorithm
    assert (a.use_tis, a.tis_clip_low, a.tis_clip) == (True, 0.5, 2.0)

    assert [(e.worker_type, e.tp_size, e.nnodes) for e in plan.engines] == [("prefill", 64, 8)] + [
        ("decode", 64, 8)
    ] * 3
    launch = EngineLaunchConfig.from_config(cfg.rollout, cfg.fault_tolerance, cfg.sglang_args, plan)
    prefill, decode = (sglang_flags(e, e.parts[0], launch) for e in plan.engines[:2])
    for flags in (prefill, decode):
        assert flags["disaggregation-transfer-backend"] == ["mooncake"]
        assert flags["disaggregation-ib-device"] == [",".join(f"mlx5_{i}" for i in range(100, 108))]
        assert flags["kv-cache-dtype"] == ["fp8_e4m3"]
        assert flags["speculative-draft-attention-backend"] == ["nsa"]
    assert (prefill["disaggregation-mode"], decode["disaggregation-mode"]) == (["prefill"], ["decode"])
    assert (prefill["deepep-mode"], decode["deepep-mode"]) == (["auto"], ["low_latency"])
    assert (prefill["max-running-requests"], decode["max-running-requests"]) == (["512"], ["768"])
    assert decode["moe-runner-backend"] == ["deep_gemm"] and "moe-runner-backend" not in prefill
    assert decode["cuda-graph-max-bs"] == ["12"] and prefill["cuda-graph-max-bs"] == ["8"]

    # Without --decoder-first/last-pipeline-num-layers, PP 8 splits the 78 layers unevenly (refused),
    # and an even split, PP 2 (39 layers a stage), starts its second stage on layer 40 (1-based),
    # which reuses layer 39's top-k; the script's split turned around (16 / 6 x 8 / 14) starts one on
    # layer 17. Each is refused, naming the layer (0-based) the stage would start on.
    first, last = (
        argv.index("--decoder-first-pipeline-num-layers"),
        argv.index("--decoder-last-pipeline-num-layers"),
    )
    assert last == first + 2
    uniform = argv[:first] + argv[last + 2 :]
    with pytest.raises(
        ConfigError, match=r"--num-layers=78: leaves 78 .* --pipeline-model-parallel-size=8 stages"
    ):
        plan_for(uniform, eight_gpu_nodes(32))
    even = _replaced(uniform, {"--pipeline-model-parallel-size": "2"})
    with pytest.raises(
        ConfigError, match=r"--pipeline-model-parallel-size=2: a stage would start at layer 39 "
    ):
        plan_for(even, eight_gpu_nodes(32))
    turned = _replaced(
        argv, {"--decoder-first-pipeline-num-layers": "16", "--decoder-last-pipeline-num-layers": "14"}
    )
    with pytest.raises(
        ConfigError, match=r"--pipeline-model-parallel-size=8: a stage would start at layer 16 "
    ):
        plan_for(turned, eight_gpu_nodes(32))


def test_the_glm47_flash_script_is_refused_for_its_expert_layout(tmp_path: Path) -> None:
    """slime's run-glm4.7-30B-A3B.sh trains on 1 x 8 GPUs with EP 8 and PP 2: Megatron lays the experts
    out on a grid of EP x ETP x PP = 16 ranks, which 8 ranks cannot tile (initialize_model_parallel
    raises), so `tether plan` refuses it, naming --expert-model-parallel-size. On two nodes the layout
    tiles and every other flag plans as the script passes it, colocated with PP 2: GLM-4.7-Flash's MLA
    model flags (--add-qkv-bias, which MLA never reads, included), its MTP training, DeepEP and EAGLE."""
    argv = with_local_paths(GLM47_FLASH, "glm4.7-flash", tmp_path)
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size=8: EP x ETP x PP = 16 .* 8 trainer"):
        plan_for(argv)
    cfg, plan = plan_for(_replaced(argv, {"--actor-num-nodes": "2"}), eight_gpu_nodes(2))
    assert plan.colocate and cfg.megatron.pipeline_model_parallel_size == 2
    m = cfg.megatron
    assert m.multi_latent_attention and (m.mtp_num_layers, m.enable_mtp_training) == (1, True)
    assert (m.moe_token_dispatcher_type, m.moe_enable_deepep) == ("flex", True)
    assert [engine.tp_size for engine in plan.engines] == [8, 8]


def test_deepep_is_checked_on_the_trainer_ranks_not_in_the_plan(tmp_path: Path) -> None:
    """--moe-enable-deepep with the flex dispatcher (slime's Moonlight, DeepSeek-R1, GLM-4.7 scripts):
    a GPU plan is made where the ranks' libraries may not be, so `tether plan` accepts it; each trainer
    rank checks its own capabilities before building the model and refuses it without deep_ep."""
    cfg, _ = plan_for(with_local_paths(MOONLIGHT_16B_A3B, "moonlight-16B-A3B", tmp_path))
    assert (cfg.megatron.moe_token_dispatcher_type, cfg.megatron.moe_enable_deepep) == ("flex", True)
    check_capabilities(cfg.megatron, Capabilities.full_gpu())
    without = dataclasses.replace(Capabilities.full_gpu(), deep_ep=False)
    with pytest.raises(ConfigError, match=r"--moe-enable-deepep=True: needs the deep_ep module \(DeepEP\)"):
        check_capabilities(cfg.megatron, without)


# --- quantized checkpoints -------------------------------------------------------------------------


def _int4_quantization(group_size: int, symmetric: bool) -> dict[str, object]:
    """An INT4 checkpoint's quantization_config as slime's tools/convert_hf_to_int4_direct.py writes it
    (compressed-tensors, int4 weights in groups; attention, shared experts, dense MLPs, routers,
    norms, embeddings and lm_head left unquantized)."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group_size,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": symmetric,
        "type": "int",
    }
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "pack-quantized",
        "ignore": [
            "re:.*lm_head.*",
            "re:.*norm.*",
            "re:.*embed.*",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*mlp\\.gate\\.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


# Block FP8 as DeepSeek-V3/R1 publish it and slime's tools/convert_hf_to_fp8.py writes it.
_FP8_BLOCK = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# The checkpoints slime's scripts point --hf-checkpoint at, quantized: the INT4 scripts' (converted
# as slime's docs run the tool, at the OPEN_TRAINING_INT4_GROUP_SIZE each script passes: 128; Kimi-K2-
# Thinking's own checkpoint is compressed-tensors INT4 too, symmetric, at 32), DeepSeek-R1 as published
# (block FP8), the FP8 conversion run-kimi-k2-Thinking.sh serves, and GLM-5.2-FP8, the FP8 release
# run-glm5.2-744B-A40B.sh serves (its quantization_config not at hand: block FP8 as slime's converter
# writes it; any quant_method is refused alike).
for _model, _quant in (
    ("qwen3-30B-A3B", _int4_quantization(128, symmetric=False)),
    ("moonlight-16B-A3B", _int4_quantization(128, symmetric=False)),
    ("qwen3-235B-A22B", _int4_quantization(128, symmetric=False)),
    ("kimi-k2-thinking", _int4_quantization(32, symmetric=True)),
    ("deepseek-r1", _FP8_BLOCK),
):
    HF_CONFIGS[f"{_model}-{_quant['quant_method']}"] = {**HF_CONFIGS[_model], "quantization_config": _quant}
HF_CONFIGS["kimi-k2-thinking-fp8"] = {**HF_CONFIGS["kimi-k2-thinking"], "quantization_config": _FP8_BLOCK}
HF_CONFIGS["glm5.2-744B-A40B-fp8"] = {**HF_CONFIGS["glm5.2-744B-A40B"], "quantization_config": _FP8_BLOCK}

# script path in slime -> (its arguments, its quantized checkpoint's model)
QUANTIZED: dict[str, tuple[list[str], str]] = {
    "scripts/low_precision/run-qwen3-30B-A3B-int4.sh": (
        QWEN3_30B_A3B_INT4,
        "qwen3-30B-A3B-compressed-tensors",
    ),
    "scripts/low_precision/run-moonlight-16B-A3B-int4.sh": (
        MOONLIGHT_16B_A3B_INT4,
        "moonlight-16B-A3B-compressed-tensors",
    ),
    "scripts/low_precision/run-qwen3-235B-A22B-int4.sh": (
        QWEN3_235B_A22B_INT4,
        "qwen3-235B-A22B-compressed-tensors",
    ),
    "scripts/low_precision/run-kimi-k2-Thinking-int4.sh": (
        KIMI_K2_THINKING_INT4,
        "kimi-k2-thinking-compressed-tensors",
    ),
    "scripts/run-kimi-k2-Thinking.sh": (KIMI_K2_THINKING, "kimi-k2-thinking-fp8"),
    "scripts/run-deepseek-r1.sh": (DEEPSEEK_R1, "deepseek-r1-fp8"),
    "scripts/run-glm5.2-744B-A40B.sh": (GLM52_744B_A40B, "glm5.2-744B-A40B-fp8"),
}


@pytest.mark.parametrize("script", sorted(QUANTIZED))
def test_quantized_checkpoints_are_refused(script: str, tmp_path: Path) -> None:
    """slime trains these scripts' BF16 weights (the INT4 ones with fake INT4 quantization) and
    quantizes each weight it sends to SGLang by the checkpoint's quantization_config
    (megatron_to_hf/processors quantize_params). tether sends unquantized weights, which engines
    serving the quantized checkpoint cannot take: the script is refused, naming the config's key and
    method. The same flags against the unquantized checkpoint plan (the tests above)."""
    argv, model = QUANTIZED[script]
    quant = HF_CONFIGS[model]["quantization_config"]
    assert isinstance(quant, dict)
    with pytest.raises(ConfigError) as err:
        resolve(with_local_paths(argv, model, tmp_path))
    assert err.value.key.endswith("config.json:quantization_config"), err.value
    assert str(quant["quant_method"]) in str(err.value) and "does not quantize" in str(err.value)


def test_the_scripts_are_kept() -> None:
    kept = {*SCRIPTS, *MULTI_NODE_SCRIPTS, "scripts/run-glm4.7-30B-A3B.sh"}
    assert len(kept) == len(SCRIPTS) + len(MULTI_NODE_SCRIPTS) + 1 == 31

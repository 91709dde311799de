"""slime's own launch scripts pass `tether plan` unchanged (issue #19).

Each entry is the argument list a script of THUDM/slime passes to `train.py`, in the script's order
(its MODEL_ARGS from scripts/models/<model>.sh, then CKPT_ARGS, ROLLOUT_ARGS, ... as it expands them),
with slime's values. Only the paths are replaced, by files and directories the test creates: a
config.json with the architecture the MODEL_ARGS assert for --hf-checkpoint, JSONL prompt files, and
checkpoint directories. Each list is resolved by tether's parser, its hooks checked and its placement
planned on one 8-GPU node, exactly as `tether plan` does, without starting anything.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import msgspec
import pytest

from tether.config import Config, horizon_note, resolve, with_counted_epochs
from tether.placement.inventory import Gpu, Inventory, Node
from tether.placement.plan import Plan, plan_from_config
from tether.rollout.hooks.checks import check_hooks
from tether.runtime.errors import ConfigError
from tether.train.model import megatron_args

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

# script path in slime -> (its arguments, the model its MODEL_ARGS describe)
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
}

# Flags whose values are paths, and what the test puts there instead.
_DIR_FLAGS = {"--ref-load", "--load", "--save"}
_DATA_FLAGS = {"--prompt-data"}
_PROMPT = {"prompt": "What is 1 + 1?", "messages": [{"role": "user", "content": "1 + 1?"}], "label": "2"}


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
        else:
            out.append(token)
    return out


def one_node(gpus: int) -> Inventory:
    return Inventory(
        nodes=[Node(hostname="n0", address="10.0.0.1", gpus=[Gpu(index=g) for g in range(gpus)])]
    )


def plan_for(argv: list[str]) -> tuple[Config, Plan]:
    """What `tether plan` does with these flags (resolve, check hooks, place), on an 8-GPU node."""
    cfg = resolve(argv)
    if not cfg.debug.debug_train_only:
        check_hooks(cfg.rollout)
    plan = plan_from_config(
        cfg.cluster, cfg.debug.debug_rollout_only, cfg.debug.debug_train_only, one_node(8), lambda _: None
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


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_slime_script_plans_unchanged(script: str, tmp_path: Path, search_hooks: None) -> None:
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
    nodes = Inventory(
        nodes=[
            Node(hostname=f"n{i}", address=f"10.0.0.{i + 1}", gpus=[Gpu(index=g) for g in range(8)])
            for i in range(16)
        ]
    )
    plan = plan_from_config(cfg.cluster, False, False, nodes, lambda _: None)
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


def test_six_scripts_are_kept() -> None:
    assert len(SCRIPTS) >= 6


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
    """MiniMax-M2's MODEL_ARGS on one 8-GPU node. Its script's own layout is refused today: engines of
    16 GPUs across nodes (issue #34), and PP 2 under --colocate."""
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

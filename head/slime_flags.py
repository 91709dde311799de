"""slime's flags (and Megatron-LM flags slime's scripts pass) that tether does not implement, each
with the reason: `tether plan` and `tether run`
refuse them by name with it (instead of "not a flag"), and the README lists them.

Every other flag of slime's argument parser (slime/utils/arguments.py) is a tether flag with slime's
meaning; tests/unit/test_config_slime_flags.py keeps this table and tether's flags apart.
"""

from __future__ import annotations

NOT_IMPLEMENTED: dict[str, str] = {
    # context parallelism and its data layout
    "--allgather-cp": "context parallelism is not supported (--context-parallel-size must be 1)",
    "--data-pad-size-multiplier": "tether pads micro-batches by its own plan; no padding multiplier applies",
    # micro-batch planning and trainer memory
    "--balance-by-flops": "micro-batches are packed by tokens (--use-dynamic-batch-size); FLOPs-based "
    "Karmarkar-Karp partitioning is not implemented",
    "--log-probs-chunk-size": "log-probs are computed per micro-batch without chunking the vocabulary",
    "--log-probs-max-tokens-per-gpu": "log-prob passes use the training micro-batch plan (--max-tokens-per-gpu)",
    "--recompute-loss-function": "the loss is not recomputed in the backward pass",
    "--memory-recorder": "no memory recorder; use torch's profiler on a trainer rank",
    "--memory-snapshot-dir": "no CUDA memory snapshots",
    "--memory-snapshot-num-steps": "no CUDA memory snapshots",
    "--record-memory-history": "no CUDA memory snapshots",
    "--profile-target": "no built-in profiler targets",
    "--release-train": "trainer ranks stay up for the whole run (--offload-train frees their memory instead)",
    "--train-backend": "tether trains with Megatron only",
    "--use-stateless-adam": "not implemented",
    "--keep-old-actor": "not implemented: the old policy's log-probs are computed before each step",
    "--reset-optimizer-states": "not implemented",
    "--ref-update-interval": "not implemented: the reference model stays as loaded",
    "--freeze-params-name-list": "not implemented: every parameter trains",
    "--only-train-params-name-list": "not implemented: every parameter trains",
    "--freeze-indexer": "DeepSeek sparse-attention indexers are not built",
    # losses and corrections slime has and tether does not
    "--custom-pg-loss-reducer-function-path": "the policy loss is reduced by --calculate-per-token-loss or the "
    "per-sample mean; custom reducers are not implemented",
    "--custom-tis-function-path": "truncated importance sampling is --use-tis with --tis-clip/--tis-clip-low; "
    "custom TIS/MIS functions are not implemented",
    "--get-mismatch-metrics": "needs --custom-tis-function-path, which is not implemented",
    "--use-opsm": "off-policy sequence masking is not implemented",
    "--opsm-delta": "off-policy sequence masking is not implemented",
    "--use-rollout-entropy": "entropy is not computed in the log-prob passes",
    "--value-clip": "there is no critic (advantage estimator ppo is not implemented)",
    "--num-critic-only-steps": "there is no critic (advantage estimator ppo is not implemented)",
    "--megatron-config-path": "there is no critic role to configure",
    # on-policy distillation
    "--use-opd": "on-policy distillation is not implemented",
    "--opd-type": "on-policy distillation is not implemented",
    "--opd-kl-coef": "on-policy distillation is not implemented",
    "--opd-teacher-load": "on-policy distillation is not implemented",
    "--opd-teacher-ckpt-step": "on-policy distillation is not implemented",
    # model building that goes around the bridge
    "--custom-model-provider-path": "models are built through the bridge from --hf-checkpoint's config",
    "--custom-megatron-init-path": "no custom Megatron initialisation hook",
    "--custom-megatron-before-log-prob-hook-path": "no Megatron hooks around the log-prob pass",
    "--custom-megatron-before-train-step-hook-path": "no Megatron hooks around the train step",
    "--megatron-deepgemm-forward-layers": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-forward-modules": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-moe-forward-layers": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-moe-forward-modules": "no DeepGEMM FP8 forward",
    "--qwen-gdn-backend": "Qwen linear-attention (GDN) layers are not built",
    "--enable-mtp-training": "multi-token-prediction layers are not trained",
    "--mtp-num-layers": "multi-token-prediction layers are not built",
    "--mtp-loss-scaling-factor": "multi-token-prediction layers are not built",
    "--model-name": "the HF architecture comes from --hf-checkpoint's config.json",
    # data and rollout plumbing slime has around Ray
    "--data-source-path": "the data source is tether's (--prompt-data, with its saved position); custom data "
    "source classes are not implemented",
    "--disable-rollout-global-dataset": "prompts always come from --prompt-data's data source",
    "--custom-convert-samples-to-train-data-path": "training data is built columnar from the Samples; "
    "custom conversions are not implemented (--custom-reward-post-process-path and "
    "--custom-advantage-function-path are)",
    "--rollout-data-postprocess-path": "no hook after the log-prob passes",
    "--rollout-data-transport": "Samples move over tether's ZeroMQ RPC; no Ray/NIXL transport",
    "--rollout-buffer-url": "slime's external rollout buffer is not supported",
    "--fetch-trajectory-retry-times": "slime's external rollout buffer is not supported",
    "--min-batch-collection-ratio": "slime's external rollout buffer is not supported",
    "--rollout-task-type": "slime's external rollout buffer is not supported",
    "--load-forge-rollout-data": "use --load-debug-rollout-data",
    "--load-debug-rollout-data-subsample": "saved rollouts are replayed whole",
    "--use-distributed-post": "needs Ray",
    "--http-proxy": "engines and reward services are reached directly",
    "--multimodal-keys": "tether trains on text only",
    "--custom-config-path": "hook arguments come from the command line and `args`; no extra YAML",
    "--log-correct-samples": "needs the trainer's per-sample entropy, which is not logged",
    "--check-weight-update-equal": "the engines' log-probs are compared with the trainer's every step instead "
    "(train/train_rollout_logprob_abs_diff)",
    # Megatron flags slime's parser redefines
    "--async-save": "checkpoints are written synchronously (atomically, with digests)",
    "--no-save-optim": "checkpoints always hold the optimizer state, which a resume needs",
    "--ref-ckpt-step": "--ref-load loads the checkpoint its tracker names",
    "--distributed-backend": "the backend follows the device: NCCL on GPUs, gloo on CPU",
    "--padded-vocab-size": "the vocabulary is padded by --make-vocab-size-divisible-by",
    # slime's CI switches
    "--ci-test": "slime's own CI checks",
    "--ci-disable-kl-checker": "slime's own CI checks",
    "--ci-load-grad-norm": "slime's own CI checks",
    "--ci-save-grad-norm": "slime's own CI checks",
    "--ci-train-rollout-logprob-abs-diff-threshold": "slime's own CI checks",
}
"""slime flag -> why tether refuses it."""

MEGATRON_NOT_IMPLEMENTED: dict[str, str] = {
    "--spec": "layer specs come from the model family (GLM-4's post-sublayer norms are built in); drop it",
    "--moe-enable-deepep": "DeepEP token dispatch needs CUDA and DeepEP; use --moe-token-dispatcher-type alltoall",
    "--use-gated-attention": "gated attention layers are not built",
    "--attention-output-gate": "gated attention layers are not built",
    "--apply-layernorm-1p": "zero-centred (1p) layer norms are not built",
}
"""Megatron-LM flags slime's scripts pass that tether refuses, and why."""


def refusal(flag: str) -> str | None:
    """Why `flag` is refused, when it is one of slime's flags tether does not implement."""
    name = flag.split("=", 1)[0]
    if name in NOT_IMPLEMENTED:
        return f"is slime's flag, not supported by tether: {NOT_IMPLEMENTED[name]}"
    if name in MEGATRON_NOT_IMPLEMENTED:
        return f"is Megatron-LM's flag, not supported by tether: {MEGATRON_NOT_IMPLEMENTED[name]}"
    return None

"""slime's flags (and Megatron-LM flags slime's scripts pass) that tether does not implement, each
with the reason: `tether plan` and `tether run`
refuse them by name with it (instead of "not a flag"), and the README lists them.

Every other flag of slime's argument parser (slime/utils/arguments.py) is a tether flag with slime's
meaning; tests/unit/test_config_slime_flags.py keeps this table and tether's flags apart.
"""

from __future__ import annotations

NOT_IMPLEMENTED: dict[str, str] = {
    # context parallelism and its data layout
    "--allgather-cp": "slime's contiguous all-gather CP layout exists for DeepSeek sparse-attention "
    "(DSA) models only, which tether does not build; tether's context parallelism uses Megatron's "
    "load-balanced chunks",
    "--data-pad-size-multiplier": "tether pads micro-batches by its own plan; no padding multiplier applies",
    # micro-batch planning and trainer memory
    "--balance-by-flops": "micro-batches are packed by tokens (--use-dynamic-batch-size); FLOPs-based "
    "Karmarkar-Karp partitioning is not implemented",
    "--recompute-loss-function": "the loss is not recomputed in the backward pass",
    "--memory-recorder": "no memory recorder; use torch's profiler on a trainer rank",
    "--memory-snapshot-dir": "no CUDA memory snapshots",
    "--memory-snapshot-num-steps": "no CUDA memory snapshots",
    "--record-memory-history": "no CUDA memory snapshots",
    "--profile-target": "no built-in profiler targets",
    "--release-train": "trainer ranks stay up for the whole run (--offload-train frees their memory instead)",
    "--train-backend": "tether trains with Megatron only",
    "--use-stateless-adam": "not implemented",
    "--freeze-indexer": "DeepSeek sparse-attention indexers are not built",
    # losses and corrections slime has and tether does not
    "--use-opsm": "off-policy sequence masking is not implemented",
    "--opsm-delta": "off-policy sequence masking is not implemented",
    "--megatron-config-path": "per-role (actor/critic) Megatron overrides from YAML are not implemented: "
    "the ppo critic inherits every actor flag, as slime's does without this file",
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
    # data and rollout plumbing slime has around Ray
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
    # Megatron flags slime's parser redefines
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

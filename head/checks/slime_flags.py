"""slime's flags (and Megatron-LM flags slime's scripts pass) that tether does not implement, each
with the reason: `tether plan` and `tether run`
refuse them by name with it (instead of "not a flag"), and the README lists them.

Every other flag of slime's argument parser (slime/utils/arguments.py) is a tether flag with slime's
meaning; tests/unit/test_config_slime_flags.py keeps this table and tether's flags apart.
"""

from __future__ import annotations

NOT_IMPLEMENTED: dict[str, str] = {
    # trainer memory
    "--release-train": "slime stops its Megatron train actors after each rollout's training and starts "
    "new ones that reload from --save before the next; tether's trainer ranks are one torchrun job kept "
    "for the whole run (their process groups, the weight-sync transport to the engines and the head's "
    "health watch are bound to it), and restarting that job every rollout is not implemented. Use "
    "--offload-train (the default under --colocate): after each weight update it moves the trainer's "
    "weights, gradients and optimizer state to host memory while the engines generate, and back before "
    "the next train step",
    "--train-backend": "tether trains with Megatron only",
    # model building that goes around the bridge
    "--megatron-deepgemm-forward-layers": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-forward-modules": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-moe-forward-layers": "no DeepGEMM FP8 forward",
    "--megatron-deepgemm-moe-forward-modules": "no DeepGEMM FP8 forward",
    # data and rollout plumbing slime has around Ray
    "--rollout-data-transport": "Samples move over tether's ZeroMQ RPC; no Ray/NIXL transport",
    "--use-distributed-post": "needs Ray",
    "--multimodal-keys": "tether trains on text only",
    # Megatron flags slime's parser redefines
    "--distributed-backend": "the backend follows the device: NCCL on GPUs, gloo on CPU",
    "--padded-vocab-size": "the vocabulary is padded by --make-vocab-size-divisible-by",
}
"""slime flag -> why tether refuses it."""

MEGATRON_NOT_IMPLEMENTED: dict[str, str] = {}
"""Megatron-LM flags slime's scripts pass that tether refuses, and why."""


def refusal(flag: str) -> str | None:
    """Why `flag` is refused, when it is one of slime's flags tether does not implement."""
    name = flag.split("=", 1)[0]
    if name in NOT_IMPLEMENTED:
        return f"is slime's flag, not supported by tether: {NOT_IMPLEMENTED[name]}"
    if name in MEGATRON_NOT_IMPLEMENTED:
        return f"is Megatron-LM's flag, not supported by tether: {MEGATRON_NOT_IMPLEMENTED[name]}"
    return None

"""The trainer: Megatron-core ranks under torchrun, and the head-side work that feeds them.

    config.py     the trainer's flags (algorithm, Megatron, optimizer)
    rank/         the rank process, the typed head<->rank protocol, a rollout's work and calls
    model/        models through mbridge, specs, HF config and conversion, MTP
    algorithms/   advantages, losses, log-probs, the PPO critic, OPD
    checkpoint/   Megatron-format checkpoints, async save, retention, HF export
    state/        offload, weight copies, reference and old actor, frozen parameters
    parallel/     process groups, context parallelism, routing replay
    data/         slime's train-data hooks

May import tether.runtime, tether.sync and the rollout contract (Sample, configs); never the head.
"""

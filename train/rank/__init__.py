"""The rank process: the torchrun worker serving the head, its zygote, the protocol, steps, batches.
May import tether.runtime, tether.sync, the rollout contract and every other train subpackage."""

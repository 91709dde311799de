"""Checkpoints: Megatron-format save and load, async save, layout and names, retention, export to HF.
May import tether.runtime, tether.sync, tether.train.config, tether.train.model and .parallel."""

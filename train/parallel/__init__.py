"""Parallelism on a rank: process groups and topology, context parallelism, MoE routing replay.
May import tether.runtime, tether.train.config, tether.train.model and tether.train.rank's batches."""

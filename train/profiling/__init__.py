"""Profiling of the trainer ranks: torch.profiler traces of named phases, memory history and snapshots.
May import tether.runtime and torch; the rank (tether.train.rank) calls it around its work."""

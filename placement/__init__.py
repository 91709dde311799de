"""Placement: the devices of each node (inventory), the deterministic node/GPU sorter, and the
plan that says which process runs where (engines, trainer ranks, colocation, ports).
May import tether.runtime only."""

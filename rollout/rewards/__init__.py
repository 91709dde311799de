"""Rewards: built-in verifiers and reward hooks, slime's rule-based rewards, the --rm-type names.
May import tether.runtime, rollout's top-level modules, tether.rollout.hooks and .slime_api."""

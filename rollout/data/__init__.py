"""Prompt data: the data source, slime's custom data sources and data-position file, eval datasets.
May import tether.runtime, rollout's top-level modules, tether.rollout.hooks and .slime_api."""

"""Routing requests to engines: the built-in router, its HTTP front, sglang-router, the OpenAI proxy.
May import tether.runtime, tether.placement, rollout's top-level modules and tether.rollout.engine_api."""

"""Rollouts: prompts to token-level Samples through the engines, with slime's hooks.

The Sample contract (sample.py) and the rollout flags (config.py) at the top with the rollout
loop, fully-async worker, evaluation and dumps; data/, rewards/, hooks/ and routing/ beside them;
engine_api/ (how rollout and sync talk to engines), cpu_engine/ (an engine we run, reached only
over HTTP) and slime_api/ (`import slime` for hook files).

May import tether.runtime and tether.placement; never train/, sync/ or the head.
"""

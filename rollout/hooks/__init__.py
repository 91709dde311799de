"""User hooks with slime's signatures: loading, calling, checking them; the default rollout, examples.
May import tether.runtime and the rest of tether.rollout (loader.py: tether.runtime only)."""

"""tether.rollout"""

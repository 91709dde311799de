"""slime's train-data hooks on the way from samples to training data, and slime's train-data dict.
May import tether.runtime, the rollout contract, tether.train.algorithms and tether.train.rank."""

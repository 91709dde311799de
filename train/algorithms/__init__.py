"""The RL math on a rank: advantages, GAE, losses, log-probs, loss hooks, OPD and its teacher, the critic.
May import tether.runtime, the rollout contract and the other train subpackages."""

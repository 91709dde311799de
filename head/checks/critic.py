"""What a run with PPO's critic (--advantage-estimator ppo) needs from the other flags.

As in slime, ppo needs no critic flag: the critic gets as many devices as the actor and shares
them (the plan places it so, `tether.placement.plan`). tether's own --critic-num-nodes,
--critic-num-gpus-per-node and --critic-separate-gpus shape that group; without ppo there is no
critic to place, so they are refused rather than accepted and ignored.
"""

from __future__ import annotations

from tether.placement.config import ClusterConfig
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig


def uses_critic(algorithm: AlgorithmConfig) -> bool:
    """Whether the run trains a critic (slime's `use_critic`)."""
    return algorithm.advantage_estimator == "ppo"


def check_critic(algorithm: AlgorithmConfig, cluster: ClusterConfig) -> None:
    """Refuse critic placement flags without ppo, naming the flag and what to set instead."""
    if uses_critic(algorithm):
        return
    for flag, value, default in (
        ("--critic-num-nodes", cluster.critic_num_nodes, None),
        ("--critic-num-gpus-per-node", cluster.critic_num_gpus_per_node, None),
        ("--critic-separate-gpus", cluster.critic_separate_gpus, False),
    ):
        if value != default:
            raise ConfigError(
                flag,
                value,
                f"places a critic, which only --advantage-estimator ppo trains "
                f"(the run uses {algorithm.advantage_estimator})",
            )


__all__ = ["check_critic", "uses_critic"]

"""--megatron-config-path: slime's per-role YAML (`megatron: [{name, role, overrides}]`) over the
command line, each role's slices as its trainer pool starts its ranks, and what tether refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.config import resolve
from tether.runtime.errors import ConfigError
from tether.train.megatron_roles import role_config

RUN = ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--lr", "2e-6"]
PPO = [*RUN, "--advantage-estimator", "ppo"]


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "megatron.yaml"
    path.write_text(text)
    return str(path)


def test_each_role_takes_its_overrides_over_the_command_line(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
megatron:
  - name: default
    role: critic
    overrides:
      lr: 1e-5            # YAML reads this as a string; slime reads it as the flag's number
      weight_decay: 0.0
  - name: default
    role: actor
    args:                 # slime's older name for overrides
      lr: 1e-6
      lr_warmup_iters: 3
      tensor_model_parallel_size: 1   # the command line's layout, restated: accepted
""",
    )
    cfg = resolve([*PPO, "--megatron-config-path", path, "--weight-decay", "0.05"])
    actor, critic = role_config(cfg, "actor"), role_config(cfg, "critic")
    assert (actor.algorithm.lr, actor.megatron.lr_warmup_iters, actor.megatron.weight_decay) == (
        1e-6,
        3,
        0.05,
    )
    assert (critic.algorithm.lr, critic.megatron.lr_warmup_iters, critic.megatron.weight_decay) == (
        1e-5,
        0,
        0.0,
    )
    assert (cfg.algorithm.lr, cfg.megatron.weight_decay) == (2e-6, 0.05)  # the run's own flags are untouched
    assert actor.rollout is cfg.rollout


def test_a_role_without_an_entry_keeps_the_command_line(tmp_path: Path) -> None:
    path = _file(tmp_path, "megatron:\n  - {name: default, role: critic, overrides: {lr: 1e-5}}\n")
    cfg = resolve([*PPO, "--megatron-config-path", path])
    assert role_config(cfg, "actor") is cfg
    assert role_config(cfg, "critic").algorithm.lr == 1e-5
    assert role_config(resolve(PPO), "critic") == resolve(PPO)


@pytest.mark.parametrize(
    ("text", "key", "value", "reason"),
    [
        ("critic: [{overrides: {lr: 1e-5}}]\n", "--megatron-config-path", None, "top-level 'megatron' list"),
        ("megatron: {role: critic}\n", "--megatron-config-path", None, "must be a list of mappings"),
        ("megatron: [{role: reward}]\n", "megatron[].role", "reward", "must be actor or critic"),
        (
            "megatron: [{role: actor}, {role: actor}]\n",
            "--megatron-config-path",
            None,
            "2 entries with role=actor",
        ),
        (
            "megatron: [{role: actor, overrides: {no_such_key: 1}}]\n",
            "actor.overrides.no_such_key",
            1,
            "not a flag",
        ),
        ("megatron: [{role: actor, overrides: {save: /c}}]\n", "actor.overrides.save", "/c", "whole run"),
        (
            "megatron: [{role: critic, overrides: {num_nodes: 2}}]\n",
            "critic.overrides.num_nodes",
            2,
            "placement",
        ),
        (
            "megatron: [{role: critic, overrides: {tensor_model_parallel_size: 2}}]\n",
            "critic.overrides.tensor_model_parallel_size",
            2,
            "share one parallel layout",
        ),
        (
            "megatron: [{role: actor, overrides: {lr: fast}}]\n",
            "actor.overrides",
            {"lr": "fast"},
            "Expected `float`",
        ),
        ("megatron: [{role: actor, overrides: {min_lr: 1.0}}]\n", "actor", 1.0, "--min-lr: exceeds the peak"),
    ],
)
def test_a_bad_file_key_or_value_is_refused_naming_it_and_the_file(
    tmp_path: Path, text: str, key: str, value: object, reason: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError, match=reason) as err:
        resolve([*PPO, "--megatron-config-path", path])
    assert err.value.key.endswith(key) and (key == "--megatron-config-path" or path in err.value.key)
    assert err.value.value == (path if value is None else value)


def test_a_critic_entry_without_a_critic_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, "megatron: [{role: critic, overrides: {lr: 1e-5}}]\n")
    with pytest.raises(ConfigError, match="only --advantage-estimator ppo trains a critic"):
        resolve([*RUN, "--megatron-config-path", path])
    actor_only = _file(tmp_path, "megatron: [{role: actor, overrides: {lr: 1e-5}}]\n")
    assert role_config(resolve([*RUN, "--megatron-config-path", actor_only]), "actor").algorithm.lr == 1e-5


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read as YAML") as err:
        resolve([*PPO, "--megatron-config-path", str(tmp_path / "none.yaml")])
    assert err.value.key == "--megatron-config-path"

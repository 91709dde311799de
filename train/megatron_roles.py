"""slime's --megatron-config-path: per-role (actor, critic) overrides of the trainer flags from YAML.

The file's format is slime's:

    megatron:
      - name: default          # a label, unused
        role: actor            # actor | critic; at most one entry per role
        overrides:             # (or `args`, slime's older name) argparse names, not flag names
          lr: 1e-6

Precedence as in slime: the command line is every role's baseline and its role's overrides replace
single values over it; a role without an entry keeps the command line. A string where the flag
holds a number is read as that number (YAML reads `1e-6` as a string). The critic exists only with
--advantage-estimator ppo; tether's critic already trains without KL, OPD or custom advantages,
which slime's critic role switches off.

Where tether is narrower than slime, it refuses instead of ignoring, naming the key, its value and
the file: an override may set a Megatron flag (optimizer, LR schedule, loss scaling, dropout,
recompute, ...) or one of ROLE_ALGORITHM_KEYS; the parallel layout (TOPOLOGY_KEYS) must equal the
command line's, as slime's docs require; `num_nodes`/`num_gpus_per_node` (ignored by slime:
placement follows --actor-num-*/--critic-num-*) and every other key are refused. Each role's
resulting slices pass the same checks as the command line's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig, check_algorithm_against_megatron

Role = Literal["actor", "critic"]
FLAG = "--megatron-config-path"

ROLE_ALGORITHM_KEYS = frozenset(
    {
        "lr",
        "seed",
        "eps_clip",
        "eps_clip_high",
        "entropy_coef",
        "kl_loss_coef",
        "value_clip",
        "reset_optimizer_states",
        "only_train_params_name_list",
        "freeze_params_name_list",
        "log_probs_chunk_size",
    }
)
"""The algorithm flags a role may override: those only that role's own ranks and steps read."""
TOPOLOGY_KEYS = frozenset(
    {
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "sequence_parallel",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
    }
)
"""Megatron flags that shape the placement and the head's data-parallel split: one value for all roles."""
PLACEMENT_KEYS = frozenset({"num_nodes", "num_gpus_per_node"})

S = TypeVar("S", AlgorithmConfig, MegatronConfig)


def read_overrides(path: str, role: Role) -> dict[str, Any]:
    """The role's overrides in the file at `path` ({} without an entry for the role)."""
    import yaml  # only with the flag: not on every run's way to its first process

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(FLAG, path, f"cannot be read as YAML: {exc}") from exc
    example = "megatron: [{name: default, role: critic, overrides: {lr: 1e-5}}]"
    if not isinstance(raw, dict) or "megatron" not in raw:
        raise ConfigError(FLAG, path, f"needs a top-level 'megatron' list, e.g. {example}")
    entries = raw["megatron"]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(FLAG, path, f"'megatron' must be a list of mappings, e.g. {example}")
    for entry in entries:
        if entry.get("role") not in ("actor", "critic"):
            raise ConfigError(f"{FLAG} {path}: megatron[].role", entry.get("role"), "must be actor or critic")
    mine = [e for e in entries if e.get("role") == role]
    if len(mine) > 1:
        raise ConfigError(FLAG, path, f"has {len(mine)} entries with role={role}; at most one is allowed")
    if not mine:
        return {}
    overrides = mine[0].get("overrides") or mine[0].get("args") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{FLAG} {path}: {role}.overrides", overrides, "must be a mapping of flag names")
    return dict(overrides)


def role_slices(
    algorithm: AlgorithmConfig, megatron: MegatronConfig, role: Role
) -> tuple[AlgorithmConfig, MegatronConfig]:
    """The two trainer slices of `role`: the command line's, with the role's overrides applied."""
    path = algorithm.megatron_config_path
    if path is None:
        return algorithm, megatron
    overrides = read_overrides(path, role)
    if not overrides:
        return algorithm, megatron
    if role == "critic" and algorithm.advantage_estimator != "ppo":
        raise ConfigError(
            FLAG,
            path,
            f"has a critic entry, but only --advantage-estimator ppo trains a critic "
            f"(the run uses {algorithm.advantage_estimator})",
        )
    to_algorithm: dict[str, Any] = {}
    to_megatron: dict[str, Any] = {}
    for key, value in overrides.items():
        where = f"{FLAG} {path}: {role}.overrides.{key}"
        if key in PLACEMENT_KEYS:
            raise ConfigError(
                where,
                value,
                f"placement follows the command line (--{role}-num-nodes/-gpus-per-node); remove it",
            )
        if key in TOPOLOGY_KEYS:
            if _coerced(value, getattr(megatron, key)) != getattr(megatron, key):
                raise ConfigError(
                    where,
                    value,
                    f"actor and critic share one parallel layout; the command line says {getattr(megatron, key)!r}",
                )
            continue
        if key in MegatronConfig.__struct_fields__:
            to_megatron[key] = _coerced(value, getattr(megatron, key))
        elif key in ROLE_ALGORITHM_KEYS:
            to_algorithm[key] = _coerced(value, getattr(algorithm, key))
        elif key in AlgorithmConfig.__struct_fields__:
            raise ConfigError(
                where, value, "is read for the whole run, not per role; set it on the command line"
            )
        else:
            raise ConfigError(
                where, value, "is not a flag tether's trainer takes (keys are argparse names: lr)"
            )
    role_algorithm = _replaced(algorithm, to_algorithm, path, role)
    role_megatron = _replaced(megatron, to_megatron, path, role)
    try:
        check_algorithm_against_megatron(role_algorithm, role_megatron)
    except ConfigError as exc:
        raise ConfigError(f"{FLAG} {path}: {role}", exc.value, f"{exc.key}: {exc.reason}") from exc
    return role_algorithm, role_megatron


def role_config(cfg: Any, role: Role) -> Any:
    """`cfg` (a configuration with `algorithm` and `megatron` slices) as `role`'s ranks run it."""
    algorithm, megatron = role_slices(cfg.algorithm, cfg.megatron, role)
    if algorithm is cfg.algorithm and megatron is cfg.megatron:
        return cfg
    return msgspec.structs.replace(cfg, algorithm=algorithm, megatron=megatron)


def _coerced(value: Any, current: Any) -> Any:
    """slime's reading of a YAML string where the flag holds a number (`1e-5`)."""
    if isinstance(value, str) and isinstance(current, (int, float)) and not isinstance(current, bool):
        try:
            return type(current)(value)
        except ValueError:
            return value
    return value


def _replaced(base: S, changes: dict[str, Any], path: str, role: Role) -> S:
    if not changes:
        return base
    fields = {name: getattr(base, name) for name in base.__struct_fields__}
    fields.update(changes)
    try:
        return msgspec.convert(fields, type(base))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{FLAG} {path}: {role}.overrides", changes, str(exc)) from exc


__all__ = ["ROLE_ALGORITHM_KEYS", "TOPOLOGY_KEYS", "read_overrides", "role_config", "role_slices"]

"""Engine server groups: the `--sglang-config` YAML, or one regular group from the cluster flags.

The YAML follows slime's shape: either a top-level `server_groups:` list, or
`sglang: [{name: ..., server_groups: [...]}]`. Each group has `worker_type`
(regular / prefill / decode / placeholder), `num_gpus`, `num_gpus_per_engine` (default
--rollout-num-gpus-per-engine) and optional `overrides` (SGLang server arguments for its engines).
A placeholder group reserves devices without starting an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from tether.runtime.errors import ConfigError

WorkerType = Literal["regular", "prefill", "decode", "placeholder"]
OverrideValue = str | int | float | bool | None | list[str | int | float | bool]


class ServerGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A run of engines of one size and type over a contiguous range of rollout devices."""

    name: str = "default"
    worker_type: WorkerType = "regular"
    num_gpus: int
    num_gpus_per_engine: int | None = None
    overrides: dict[str, OverrideValue] = msgspec.field(default_factory=dict)


class _ModelEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "default"
    server_groups: list[ServerGroup] = msgspec.field(default_factory=list)


class _SglangYaml(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server_groups: list[ServerGroup] | None = None
    sglang: list[_ModelEntry] | None = None


def load_server_groups(path: str | Path, default_per_engine: int) -> list[ServerGroup]:
    """Groups from a YAML file, each with its engine size filled in and checked."""
    path = Path(path)
    key = "--sglang-config"
    import yaml  # only with the flag: not on every run's way to its first process

    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(key, str(path), f"cannot be read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(key, str(path), f"is not valid YAML: {exc}") from exc
    try:
        doc = msgspec.convert(raw, _SglangYaml)
    except msgspec.ValidationError as exc:
        raise ConfigError(key, str(path), f"invalid server groups: {exc}") from exc
    if (doc.server_groups is None) == (doc.sglang is None):
        raise ConfigError(key, str(path), "needs exactly one of the keys `server_groups` and `sglang`")
    if doc.server_groups is not None:
        groups = list(doc.server_groups)
    else:
        assert doc.sglang is not None
        groups = []
        for entry in doc.sglang:
            for group in entry.server_groups:
                name = group.name if group.name != "default" else entry.name
                groups.append(msgspec.structs.replace(group, name=name))
    if not groups:
        raise ConfigError(key, str(path), "declares no server groups")
    return [
        check_group(group, default_per_engine, f"{key} {path} server_groups[{i}]")
        for i, group in enumerate(groups)
    ]


def check_group(group: ServerGroup, default_per_engine: int, where: str) -> ServerGroup:
    """Fill in the engine size and check that it divides the group."""
    per_engine = group.num_gpus_per_engine if group.num_gpus_per_engine is not None else default_per_engine
    if group.num_gpus < 1:
        raise ConfigError(f"{where}.num_gpus", group.num_gpus, "must be >= 1")
    if per_engine < 1:
        raise ConfigError(f"{where}.num_gpus_per_engine", per_engine, "must be >= 1")
    if group.worker_type != "placeholder" and group.num_gpus % per_engine:
        raise ConfigError(
            f"{where}.num_gpus",
            group.num_gpus,
            f"is not a multiple of the engine size {per_engine} ({group.num_gpus % per_engine} devices left over)",
        )
    return msgspec.structs.replace(group, num_gpus_per_engine=per_engine)

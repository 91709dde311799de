"""slime's --custom-config-path: a YAML mapping whose keys become attributes of the `args` that hooks get.

slime sets every key on its argparse namespace after parsing (a key that names a flag overrides the
command line's value). tether applies the keys that name its flags when it parses the command line
(tether.config.resolve); the rest reach every hook's `args` (the rollout's, via
tether.rollout.slime_api.args, and the trainer's loss hooks, via tether.train.algorithms.loss_hooks), which
read the file with `read_custom_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError

FLAG = "--custom-config-path"


def read_custom_config(path: str | Path) -> dict[str, Any]:
    """The YAML file's mapping (empty for an empty file); ConfigError naming the flag otherwise."""
    import yaml  # only with the flag: not on every run's way to its first process

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(FLAG, str(path), f"cannot be read as YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            FLAG, str(path), f"must hold a mapping of keys to values, not {type(loaded).__name__}"
        )
    for key in loaded:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(FLAG, str(path), f"key {key!r} is not an attribute name")
    return dict(loaded)


def hook_extras(path: str | Path | None, known: set[str] | frozenset[str]) -> dict[str, Any]:
    """The file's keys that are not in `known` (the configuration's own fields, already applied):
    what hooks read from `args` beyond the flags."""
    if not path:
        return {}
    return {k: v for k, v in read_custom_config(path).items() if k not in known}

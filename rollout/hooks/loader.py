"""Importing a hook a flag names (`package.module.function`, `package.module:function` or
`file.py:function`), for the head, rollouts and trainer ranks alike.

A contract module (stdlib, the `slime.*` finder and ConfigError only): the trainer ranks load
slime-written loss hooks with it, and `train` may not import the rest of `rollout`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tether.rollout.slime_api.finder as slime_finder
from tether.runtime.errors import ConfigError


def load_function(path: str, flag: str = "hook") -> Callable[..., Any]:
    """Import `package.module.attr`, `package.module:attr` or `some/file.py:attr`.

    Raises ConfigError naming `flag` and the path when it cannot be imported or is not callable.
    First installs the import hook for `slime.*` (unless slime itself is installed).
    """
    slime_finder.install()
    try:
        if ":" in path:
            module_part, attr = path.rsplit(":", 1)
            if module_part.endswith(".py"):
                module = _import_file(Path(module_part))
            else:
                module = importlib.import_module(module_part)
        else:
            module_name, _, attr = path.rpartition(".")
            if not module_name:
                raise ConfigError(flag, path, "must be `package.module.function` or `file.py:function`")
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:  # any import-time failure is the user's file; say which flag pointed at it
        raise ConfigError(flag, path, f"cannot be imported: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(flag, path, f"module {module.__name__} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(flag, path, f"{attr!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise FileNotFoundError(f"no such file {file}")
    name = f"tether_hook_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


__all__ = ["load_function"]

"""User hooks with slime's signatures: loading them, a flat view of the config for them, and checking their output.

slime hooks read flat attributes (`args.rollout_temperature`); tether's config is nested by
component (`args.rollout.rollout_temperature`). `FlatArgs` answers both spellings, read-only.
A Sample that comes back from a hook is checked against the contract, and a bad one is rejected
with the hook's path and the field at fault.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from tether.rollout.sample import TRAINABLE, Sample, SampleContractError, SampleStatus, validate_sample
from tether.runtime.errors import ConfigError


class HookError(RuntimeError):
    """A hook broke its contract; the message names the hook's path and what was wrong."""

    def __init__(self, path: str, reason: str, *, field: str | None = None) -> None:
        self.path = path
        self.field = field
        self.reason = reason
        where = f" (field {field})" if field else ""
        super().__init__(f"hook {path}{where}: {reason}")


class FlatArgs:
    """Read-only view of a nested config: `args.x` finds field `x` in the one slice that holds it.

    Attributes of the config itself (the slices: `args.rollout`, `args.data`) resolve first,
    so code written for tether's nested config works through the same object.
    """

    __slots__ = ("_config", "_index")

    def __init__(self, config: Any) -> None:
        index: dict[str, Any] = {}
        for name in _field_names(config):
            value = getattr(config, name)
            if isinstance(value, msgspec.Struct):
                for field in _field_names(value):
                    index.setdefault(field, value)
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_index", index)

    @property
    def config(self) -> Any:
        """The nested config this view reads."""
        return self._config

    def __getattr__(self, name: str) -> Any:
        config = object.__getattribute__(self, "_config")
        if name in _field_names(config) or (not isinstance(config, msgspec.Struct) and hasattr(config, name)):
            return getattr(config, name)
        index = object.__getattribute__(self, "_index")
        if name in index:
            return getattr(index[name], name)
        raise AttributeError(f"no configuration field named {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the configuration is read-only (tried to set {name!r})")

    def __dir__(self) -> Iterable[str]:
        return sorted({*_field_names(self._config), *self._index})


def flat_args(config: Any) -> FlatArgs:
    return config if isinstance(config, FlatArgs) else FlatArgs(config)


def _field_names(obj: Any) -> tuple[str, ...]:
    fields = getattr(type(obj), "__struct_fields__", None)
    if fields is not None:
        return tuple(fields)
    return tuple(k for k in vars(obj) if not k.startswith("_")) if hasattr(obj, "__dict__") else ()


def load_function(path: str, flag: str = "hook") -> Callable[..., Any]:
    """Import `package.module.attr`, `package.module:attr` or `some/file.py:attr`.

    Raises ConfigError naming `flag` and the path when it cannot be imported or is not callable.
    """
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


async def maybe_await(value: Any) -> Any:
    """Hooks may be plain or async functions; slime accepts both for rewards and filters."""
    if inspect.isawaitable(value):
        return await value
    return value


def check_hook_samples(
    path: str,
    result: object,
    *,
    accepted: frozenset[SampleStatus] = TRAINABLE | {SampleStatus.ABORTED},
    require_reward: bool = False,
) -> list[Sample]:
    """The Samples a generate hook returned (one or a list), each checked against the contract.

    Aborted samples are accepted structurally (they are requeued, not trained); completed ones are
    validated in full. `require_reward=False` skips the reward check (rewards come later).
    """
    items: list[object] = list(result) if isinstance(result, list) else [result]
    if not items:
        raise HookError(path, "returned an empty list of samples")
    samples: list[Sample] = []
    for pos, sample in enumerate(items):
        if not isinstance(sample, Sample):
            raise HookError(path, f"returned {type(sample).__name__} at position {pos}, expected a Sample")
        samples.append(sample)
        if sample.status not in accepted:
            raise HookError(
                path,
                f"status {sample.status!r} is not one of {sorted(s.value for s in accepted)}",
                field="status",
            )
        if sample.status in TRAINABLE:
            check_sample(path, sample, require_reward=require_reward)
    return samples


def check_sample(path: str, sample: Sample, *, require_reward: bool = True) -> None:
    """Validate one trainable sample; failures become HookError(path, field)."""
    probe = sample
    if not require_reward and (sample.reward is None):
        probe = msgspec.structs.replace(sample, reward=0.0)
    try:
        validate_sample(probe, accepted_statuses=TRAINABLE | {sample.status})
    except SampleContractError as exc:
        raise HookError(path, str(exc), field=exc.field) from exc


async def call_generate_hook(
    fn: Callable[..., Awaitable[Sample | list[Sample]]],
    path: str,
    args: Any,
    sample: Sample,
    sampling_params: dict[str, Any],
) -> list[Sample]:
    """Run a custom `generate(args, sample, sampling_params)` and check what it returns."""
    result = await maybe_await(fn(flat_args(args), sample, sampling_params))
    return check_hook_samples(path, result)


def call_filter(
    fn: Callable[..., Any], path: str, args: Any, samples: Sequence[Sample]
) -> tuple[bool, str | None]:
    """Run a dynamic-sampling filter: slime's filters return a bool or an object with `.keep`/`.reason`."""
    result = fn(flat_args(args), list(samples))
    if inspect.isawaitable(result):
        raise HookError(path, "a dynamic sampling filter must be a plain function, not async")
    if isinstance(result, bool):
        return result, None
    keep = getattr(result, "keep", None)
    if keep is None:
        # numpy / torch booleans compare like bools
        try:
            return bool(result), None
        except Exception as exc:
            raise HookError(path, f"returned {result!r}; expected a bool or an object with .keep") from exc
    return bool(keep), getattr(result, "reason", None)

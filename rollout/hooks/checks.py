"""Hook paths checked before anything starts: each one imports, names a callable, and takes the
arguments it will be called with.

`tether plan` and `tether run` (before it starts a process) call `check_hooks`. A missing module,
a missing function or a signature that cannot take the call is refused as a ConfigError naming
the flag, the path and the reason: the call the hook will get, and the signature it has.

The calls, as slime makes them (tether makes the same ones):

    --rollout-function-path          fn(args, rollout_id, data_source, evaluation=False)
                                     (a function in tether's own API may omit `evaluation`)
    --custom-generate-function-path  await fn(args, sample, sampling_params)
    --custom-rm-path                 await fn(args, sample)   with --group-rm: fn(args, samples)
    --dynamic-sampling-filter-path   fn(args, samples)        not async
    --buffer-filter-path             fn(args, rollout_id, buffer, num_samples)   not async
    --rollout-sample-filter-path     fn(args, samples)        not async
    --rollout-all-samples-process-path   fn(args, all_samples, data_source)   not async
    --custom-rollout-log-function-path   fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)
    --custom-eval-rollout-log-function-path   fn(rollout_id, args, data, extra_metrics)
    --eval-function-path             fn(args, rollout_id, data_source, evaluation=True)
    --rollout-sample-hook-path       fn(args, sample, *, rollout_id=None, evaluation=False)  (each)
    --data-source-path               cls(args), with get_samples, add_samples, save, load, __len__
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether.rollout.config import RolloutConfig
from tether.rollout.data.custom_source import check_data_source_class
from tether.rollout.hooks.calls import load_function
from tether.rollout.slime_api.convert import uses_slime_api
from tether.runtime.errors import ConfigError


@dataclass(frozen=True)
class HookCall:
    """How one hook flag's function is called."""

    flag: str
    call: str
    """The call as documentation writes it: `fn(args, sample)`."""
    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()
    plain: bool = False
    """Called without await: an async function is refused."""


ROLLOUT_FUNCTION = HookCall(
    "--rollout-function-path",
    "fn(args, rollout_id, data_source, evaluation=False)",
    ("args", "rollout_id", "data_source"),
    ("evaluation",),
)
CUSTOM_GENERATE = HookCall(
    "--custom-generate-function-path",
    "await fn(args, sample, sampling_params)",
    ("args", "sample", "sampling_params"),
)
CUSTOM_RM = HookCall("--custom-rm-path", "await fn(args, sample)", ("args", "sample"))
GROUP_RM = HookCall("--custom-rm-path", "await fn(args, samples) (with --group-rm)", ("args", "samples"))
DYNAMIC_FILTER = HookCall(
    "--dynamic-sampling-filter-path", "fn(args, samples)", ("args", "samples"), plain=True
)
BUFFER_FILTER = HookCall(
    "--buffer-filter-path",
    "fn(args, rollout_id, buffer, num_samples)",
    ("args", "rollout_id", "buffer", "num_samples"),
    plain=True,
)

SAMPLE_FILTER = HookCall("--rollout-sample-filter-path", "fn(args, samples)", ("args", "samples"), plain=True)
ALL_SAMPLES_PROCESS = HookCall(
    "--rollout-all-samples-process-path",
    "fn(args, all_samples, data_source)",
    ("args", "all_samples", "data_source"),
    plain=True,
)
ROLLOUT_LOG = HookCall(
    "--custom-rollout-log-function-path",
    "fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)",
    ("rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"),
    plain=True,
)
EVAL_LOG = HookCall(
    "--custom-eval-rollout-log-function-path",
    "fn(rollout_id, args, data, extra_metrics)",
    ("rollout_id", "args", "data", "extra_metrics"),
    plain=True,
)

SAMPLE_HOOK = HookCall(
    "--rollout-sample-hook-path", "fn(args, sample, *, rollout_id=None, evaluation=False)", ("args", "sample")
)
EVAL_FUNCTION = HookCall(
    "--eval-function-path",
    "fn(args, rollout_id, data_source, evaluation=True)",
    ("args", "rollout_id", "data_source"),
    ("evaluation",),
)


def check_hook(path: str, spec: HookCall) -> Callable[..., Any]:
    """Import the hook at `path` and check it takes `spec`'s call; returns it. Raises ConfigError."""
    fn = load_function(path, spec.flag)
    keywords = spec.keywords
    if spec is ROLLOUT_FUNCTION and not uses_slime_api(fn):
        keywords = ()  # tether calls its own rollout functions with three arguments
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin or extension callable: nothing to inspect
    try:
        signature.bind(*spec.positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        raise ConfigError(
            spec.flag,
            path,
            f"cannot be called as {spec.call}: {exc}; its signature is {_name(fn)}{signature}",
        ) from None
    if spec.plain and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
        raise ConfigError(spec.flag, path, f"is async, but it is called without await: {spec.call}")
    return fn


def check_hooks(rollout: RolloutConfig) -> None:
    """Check every hook path the rollout configuration names (see the module docstring)."""
    hooks: list[tuple[str | None, HookCall]] = [
        (rollout.rollout_function_path, ROLLOUT_FUNCTION),
        (rollout.custom_generate_function_path, CUSTOM_GENERATE),
        (rollout.custom_rm_path, GROUP_RM if rollout.group_rm else CUSTOM_RM),
        (rollout.dynamic_sampling_filter_path, DYNAMIC_FILTER),
        (rollout.buffer_filter_path, BUFFER_FILTER),
        (rollout.rollout_sample_filter_path, SAMPLE_FILTER),
        (rollout.rollout_all_samples_process_path, ALL_SAMPLES_PROCESS),
        (rollout.custom_rollout_log_function_path, ROLLOUT_LOG),
        (rollout.custom_eval_rollout_log_function_path, EVAL_LOG),
        (rollout.eval_function_path, EVAL_FUNCTION),
        *((path, SAMPLE_HOOK) for path in rollout.rollout_sample_hook_path),
    ]
    for path, spec in hooks:
        if path:
            check_hook(path, spec)
    check_data_source_class(rollout.data_source_path)  # a class, cls(args), slime's DataSource methods


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__

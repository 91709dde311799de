"""User hooks with slime's signatures: loading them, a flat view of the config for them, and checking their output.

slime hooks read flat attributes (`args.rollout_temperature`); tether's config is nested by
component (`args.rollout.rollout_temperature`). `FlatArgs` answers both spellings, read-only.
A Sample that comes back from a hook is checked against the contract, and a bad one is rejected
with the hook's path and the field at fault.

Hooks written against slime's API (their module imports `slime`; see
`tether.rollout.slime_api`) get slime's Sample and may return it: the calls here convert in
both directions (`tether.rollout.slime_api.convert`), and loading a hook installs the import hook
that makes `import slime` work where slime is not installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from tether.rollout.hooks.loader import (
    load_function as load_function,  # re-exported: hooks are loaded from here
)
from tether.rollout.sample import TRAINABLE, Sample, SampleContractError, SampleStatus, validate_sample
from tether.rollout.slime_api.convert import ConversionError, copy_back, from_slime, to_slime, uses_slime_api


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
    so code written for tether's nested config works through the same object. `extra` answers
    names no slice holds (slime's flag names that tether resolves differently, the router's
    address) and wins over the slices' fields of the same name.
    """

    __slots__ = ("_config", "_extra", "_index")

    def __init__(self, config: Any, extra: Mapping[str, Any] | None = None) -> None:
        index: dict[str, Any] = {}
        for name in _field_names(config):
            value = getattr(config, name)
            if isinstance(value, msgspec.Struct):
                for field in _field_names(value):
                    index.setdefault(field, value)
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_extra", dict(extra or {}))
        object.__setattr__(self, "_index", index)

    @property
    def config(self) -> Any:
        """The nested config this view reads."""
        return self._config

    def __getattr__(self, name: str) -> Any:
        config = object.__getattribute__(self, "_config")
        if name in _field_names(config) or (not isinstance(config, msgspec.Struct) and hasattr(config, name)):
            return getattr(config, name)
        extra = object.__getattribute__(self, "_extra")
        if name in extra:
            return extra[name]
        index = object.__getattribute__(self, "_index")
        if name in index:
            return getattr(index[name], name)
        raise AttributeError(f"no configuration field named {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the configuration is read-only (tried to set {name!r})")

    def __dir__(self) -> Iterable[str]:
        return sorted({*_field_names(self._config), *self._index, *self._extra})


def flat_args(config: Any) -> FlatArgs:
    return config if isinstance(config, FlatArgs) else FlatArgs(config)


def _field_names(obj: Any) -> tuple[str, ...]:
    fields = getattr(type(obj), "__struct_fields__", None)
    if fields is not None:
        return tuple(fields)
    return tuple(k for k in vars(obj) if not k.startswith("_")) if hasattr(obj, "__dict__") else ()


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
    *,
    evaluation: bool = False,
) -> list[Sample]:
    """Run a custom `generate(args, sample, sampling_params)` and check what it returns.

    A slime-API hook gets slime's Sample and its own copy of the sampling parameters (slime's hooks
    change them per turn), and `evaluation=` when its signature has that parameter, as slime calls it.
    """
    if not uses_slime_api(fn):
        result = await maybe_await(fn(flat_args(args), sample, sampling_params))
        return check_hook_samples(path, result)
    kwargs = {"evaluation": evaluation} if _takes(fn, "evaluation") else {}
    result = await maybe_await(fn(flat_args(args), to_slime(sample), dict(sampling_params), **kwargs))
    return check_hook_samples(path, samples_from_hook(path, result))


async def call_sample_hook(
    fn: Callable[..., Any], path: str, args: Any, sample: Sample, *, rollout_id: int | None, evaluation: bool
) -> Sample:
    """Run one --rollout-sample-hook-path hook on a generated sample, as slime does: the keyword
    arguments its signature takes (`rollout_id`, `evaluation`), sync or async; it returns a Sample
    or None (the one it got, changed in place). A slime-API hook gets slime's Sample."""
    keywords = {"rollout_id": rollout_id, "evaluation": evaluation}
    try:
        params = inspect.signature(fn).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            keywords = {k: v for k, v in keywords.items() if _takes(fn, k)}
    except (TypeError, ValueError):
        pass  # a builtin or extension callable: pass both, as slime would
    given: Any = to_slime(sample) if uses_slime_api(fn) else sample
    result = await maybe_await(fn(flat_args(args), given, **keywords))
    if result is None:
        result = given
    if isinstance(result, list):
        raise HookError(path, f"returned a list of {len(result)}; a sample hook returns one Sample or None")
    (out,) = check_hook_samples(path, samples_from_hook(path, result), accepted=frozenset(SampleStatus))
    return out


def samples_from_hook(path: str, result: object) -> object:
    """What a slime-API hook returned, with slime Samples (alone or in a list) as tether's."""
    items = result if isinstance(result, list) else [result]
    out: list[object] = []
    for pos, item in enumerate(items):
        if isinstance(item, Sample):
            out.append(item)
            continue
        try:
            out.append(from_slime(item))
        except ConversionError as exc:
            where = f"sample {pos}: " if isinstance(result, list) else ""
            raise HookError(path, where + str(exc), field=exc.field) from exc
    return out if isinstance(result, list) else out[0]


def slime_samples(samples: Sequence[Sample]) -> list[Any]:
    return [to_slime(s) for s in samples]


def keep_slime_changes(path: str, given: Sequence[Any], samples: Sequence[Sample]) -> None:
    """Metadata a slime-API hook wrote into the Samples it was given stays with tether's."""
    for slime_sample, sample in zip(given, samples, strict=True):
        try:
            copy_back(slime_sample, sample)
        except ConversionError as exc:
            raise HookError(path, str(exc), field=exc.field) from exc


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def call_filter(
    fn: Callable[..., Any], path: str, args: Any, samples: Sequence[Sample], *, insufficient: bool = False
) -> tuple[bool, str | None]:
    """Run a dynamic-sampling filter: slime's filters return a bool or an object with `.keep`/`.reason`.

    `insufficient`: dropping this group would leave too few groups to fill the batch; a verdict
    with `keep_when_insufficient` (slime's `check_reward_nonzero_std_with_fallback`) then keeps it.
    """
    if uses_slime_api(fn):
        given = slime_samples(samples)
        result = fn(flat_args(args), given)
        if not inspect.isawaitable(result):
            keep_slime_changes(path, given, samples)
    else:
        result = fn(flat_args(args), list(samples))
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise HookError(path, "a dynamic sampling filter must be a plain function, not async")
    if isinstance(result, bool):
        return result, None
    keep = getattr(result, "keep", None)
    if (
        keep is not None
        and not bool(keep)
        and insufficient
        and getattr(result, "keep_when_insufficient", False)
    ):
        return True, None
    if keep is None:
        # numpy / torch booleans compare like bools
        try:
            return bool(result), None
        except Exception as exc:
            raise HookError(path, f"returned {result!r}; expected a bool or an object with .keep") from exc
    return bool(keep), getattr(result, "reason", None)


BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]
"""Takes up to `n` groups out of the buffer (removing them from it) and returns them."""


def buffer_filter(fn: Callable[..., Any], path: str, args: Any) -> BufferFilter:
    """A --buffer-filter-path hook as the data source calls it: slime's
    `filter(args, rollout_id, buffer, num_samples) -> list[list[Sample]]`, which removes the groups
    it returns from `buffer` (rollout_id is None, as in slime)."""
    slime = uses_slime_api(fn)

    def select(buffer: list[list[Sample]], n: int) -> list[list[Sample]]:
        if not slime:
            taken = fn(flat_args(args), None, buffer, n)
            return _check_taken(path, taken, buffer, n)
        # The hook sees slime groups; what it leaves in its list stays buffered, as tether's groups.
        mirror = [slime_samples(group) for group in buffer]
        original = {id(view): group for view, group in zip(mirror, buffer, strict=True)}
        taken = fn(flat_args(args), None, mirror, n)
        if not isinstance(taken, list):
            raise HookError(path, f"returned {type(taken).__name__}; expected a list of groups")
        buffer[:] = [original.get(id(view)) or _group_from_hook(path, view) for view in mirror]
        out = [original.get(id(view)) or _group_from_hook(path, view) for view in taken]
        return _check_taken(path, out, buffer, n)

    return select


def _group_from_hook(path: str, group: object) -> list[Sample]:
    if not isinstance(group, list):
        raise HookError(path, f"returned a group of type {type(group).__name__}; expected a list of Samples")
    samples = samples_from_hook(path, group)
    assert isinstance(samples, list)
    return [s for s in samples if isinstance(s, Sample)]


def _check_taken(path: str, taken: object, buffer: list[list[Sample]], n: int) -> list[list[Sample]]:
    if inspect.isawaitable(taken):
        if inspect.iscoroutine(taken):
            taken.close()
        raise HookError(path, "a buffer filter must be a plain function, not async")
    if not isinstance(taken, list):
        raise HookError(path, f"returned {type(taken).__name__}; expected a list of groups")
    if len(taken) > n:
        raise HookError(path, f"returned {len(taken)} groups; {n} were asked for")
    left = {id(g) for g in buffer}
    for pos, group in enumerate(taken):
        if not isinstance(group, list) or not group or not all(isinstance(s, Sample) for s in group):
            raise HookError(path, f"group {pos} is not a non-empty list of Samples: {group!r:.120}")
        if id(group) in left:
            raise HookError(
                path, f"returned group {pos} but left it in the buffer too (remove what you return)"
            )
    return taken

"""Samples across the boundary: tether's `Sample` (a msgspec Struct, the trainer's contract) and
slime's (`slime.utils.types.Sample`, a dataclass hooks build and read).

`to_slime` gives a hook slime's Sample for one of tether's; `from_slime` takes back what a hook
returned. Everything both shapes hold travels unchanged. Attributes a hook sets beyond slime's
fields (`sample.tool_call_count = 2`, say) ride along in tether's `metadata[SLIME_ATTRS]` and come
back as attributes in the next hook, so a value must be what msgpack can carry. Following slime,
a response without a loss mask trains on every token, and a log-prob under a 0 in the loss mask is
set to 0 (tether's contract; nothing trains on it). slime fields tether cannot train with
(multimodal inputs, top-p replay) are refused, naming the field; teacher log-probs (on-policy
distillation) travel as floats, one per response token. MoE routed
experts (`rollout_routed_experts`, a tensor, array or nested list [len(tokens)-1, layers, topk])
become tether's `RoutedExperts` and come back as an int32 numpy array. slime's
`remove_sample` becomes an all-zero loss mask (the sample trains nothing, as in slime), and a
sample whose mask is all zero goes to a hook with `remove_sample` set.

`uses_slime_api(fn)` tells whether a hook was written against slime's API (its module or body
imports `slime`), and so takes slime Samples.
"""

from __future__ import annotations

import enum
import math
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from tether.rollout.sample import RoutedExperts, Sample, SampleStatus
from tether.rollout.slime_api.finder import MIRRORED, target_of
from tether.rollout.slime_api.utils import types as slime_types

SLIME_ATTRS = "slime_attrs"
"""tether `Sample.metadata` key holding the extra attributes a hook set on a slime Sample."""

_CARRIED = frozenset(
    {
        "group_index",
        "index",
        "rollout_id",
        "prompt",
        "tokens",
        "response",
        "response_length",
        "label",
        "reward",
        "loss_mask",
        "weight_versions",
        "rollout_log_probs",
        "status",
        "metadata",
        "session_id",
    }
)
"""slime fields that tether's Sample holds too."""

_KEPT_AS_ATTRS = ("generate_function_path", "custom_rm_path", "apply_chat_template_kwargs")
"""slime fields tether has no field for, carried in metadata when set."""

_DROPPED = ("spec_info", "prefix_cache_info", "non_generation_time")
"""Per-sample statistics of slime's engines; tether records its own metrics."""

_REFUSED: dict[str, str] = {
    "multimodal_inputs": "tether trains on text only",
    "multimodal_train_inputs": "tether trains on text only",
    "multimodal_train_input_id": "tether trains on text only",
    "rollout_top_p_token_ids": "tether's trainer has no top-p replay",
    "rollout_top_p_token_offsets": "tether's trainer has no top-p replay",
    "train_metadata": "tether's trainer takes no per-sample training metadata",
}


class ConversionError(ValueError):
    """A slime Sample does not fit tether's Sample; names the field and the value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        text = repr(value)
        super().__init__(f"{field}={text if len(text) <= 120 else text[:117] + '...'} {reason}")


def slime_sample_class() -> type[Any]:
    """The `Sample` class hooks import as `slime.utils.types.Sample`: the real slime's when that is
    loaded, else tether's."""
    module = sys.modules.get("slime.utils.types")
    cls = getattr(module, "Sample", None)
    return cls if isinstance(cls, type) else slime_types.Sample


def is_slime_sample(obj: object) -> bool:
    """A Sample of slime's shape: tether's mirror of it, or the real slime's."""
    cls = type(obj)
    module = getattr(cls, "__module__", "")
    return cls.__name__ == "Sample" and module in ("slime.utils.types", target_of("slime.utils.types"))


_API_MODULES = frozenset(target_of(name) for name in MIRRORED)
"""tether's modules that are slime's API (not the glue beside them: finder, convert, args, bridge)."""


def uses_slime_api(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is written against slime's API: defined in a module of tether's slime API, or
    its module or its own body imports from `slime` (tether's modules that only use the glue, such
    as tether.rollout.rewards.scoring, do not count)."""
    target = getattr(fn, "__func__", fn)
    module_name = getattr(target, "__module__", None) or ""
    if _is_slime_name(module_name):
        return True
    code = getattr(target, "__code__", None)
    if code is not None and any(_is_slime_name(n) for n in code.co_names):
        return True
    module = sys.modules.get(module_name)
    if module is None:
        return False
    for value in list(vars(module).values()):
        if isinstance(value, type(sys)):
            if _is_slime_name(value.__name__):
                return True
        elif _is_slime_name(getattr(value, "__module__", None) or ""):
            return True
    return False


def _is_slime_name(name: str) -> bool:
    return name == "slime" or name.startswith("slime.") or name in _API_MODULES


# ----- tether → slime -----
def to_slime(sample: Sample) -> Any:
    """slime's Sample for one of tether's: fields copied (lists copied, metadata shallow-copied)."""
    cls = slime_sample_class()
    metadata = dict(sample.metadata)
    extras: dict[str, Any] = metadata.pop(SLIME_ATTRS, None) or {}
    out = cls(
        group_index=sample.group_index,
        index=sample.index,
        rollout_id=sample.rollout_id,
        prompt=sample.prompt,
        tokens=list(sample.tokens),
        response=sample.response,
        response_length=sample.response_length,
        label=sample.label,
        reward=sample.reward,
        loss_mask=None if sample.loss_mask is None else list(sample.loss_mask),
        weight_versions=list(sample.weight_versions),
        rollout_log_probs=None if sample.rollout_log_probs is None else list(sample.rollout_log_probs),
        teacher_log_probs=None if sample.teacher_log_probs is None else list(sample.teacher_log_probs),
        status=cls.Status(sample.status.value),
        metadata=metadata,
        session_id=sample.session_id,
    )
    if sample.rollout_routed_experts is not None:
        # A copy: slime code may write into the array (torch.as_tensor shares it).
        out.rollout_routed_experts = sample.rollout_routed_experts.array().copy()
    for name, value in extras.items():
        setattr(out, name, value)
    if sample.loss_mask and not any(sample.loss_mask):
        out.remove_sample = True  # no token trains: slime's way of saying so
    return out


# ----- slime → tether -----
def from_slime(obj: Any) -> Sample:
    """tether's Sample for a slime one (a tether Sample passes through); raises ConversionError."""
    if isinstance(obj, Sample):
        return obj
    if not is_slime_sample(obj):
        raise ConversionError("sample", type(obj).__name__, "is not a Sample (slime's or tether's)")
    attrs = dict(vars(obj))
    for name, reason in _REFUSED.items():
        value = attrs.get(name)
        if value is not None and value != {} and not (isinstance(value, Mapping) and not any(value.values())):
            raise ConversionError(name, value, f"is set, but {reason}")
    status = _status(attrs.get("status"))
    tokens = _ints("tokens", attrs.get("tokens"))
    response_length = attrs.get("response_length", 0)
    if type(response_length) is not int and isinstance(response_length, numbers.Integral):
        response_length = int(response_length)
    loss_mask = attrs.get("loss_mask")
    loss_mask = _ints("loss_mask", loss_mask) if loss_mask is not None else None
    if loss_mask is None and isinstance(response_length, int) and response_length > 0:
        loss_mask = [1] * response_length  # slime's rule: no mask means every response token trains
    log_probs = attrs.get("rollout_log_probs")
    log_probs = _floats("rollout_log_probs", log_probs) if log_probs is not None else None
    if log_probs is not None and loss_mask is not None and len(log_probs) == len(loss_mask):
        log_probs = [lp if m else 0.0 for lp, m in zip(log_probs, loss_mask, strict=True)]
    if attrs.get("remove_sample") and loss_mask is not None:
        # slime's remove_sample: the sample stays in the batch (and its group's normalisation) but
        # no token of it trains, which is what slime's train-data conversion does with it.
        loss_mask = [0] * len(loss_mask)
    teacher = attrs.get("teacher_log_probs")
    teacher = _floats("teacher_log_probs", _host(teacher)) if teacher is not None else None
    metadata = attrs.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ConversionError("metadata", metadata, "must be a dict")
    metadata = dict(metadata)
    extras = {
        name: value
        for name, value in attrs.items()
        if name not in slime_types.SAMPLE_FIELDS and not name.startswith("_")
    }
    for name in _KEPT_AS_ATTRS:
        value = attrs.get(name)
        if value:
            extras[name] = value
    for name, value in extras.items():
        try:
            msgspec.msgpack.encode(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConversionError(
                name, value, f"was set on the Sample but cannot be carried with it (not msgpack data: {exc})"
            ) from exc
    if extras:
        metadata[SLIME_ATTRS] = extras
    weight_versions = attrs.get("weight_versions") or []
    routed = attrs.get("rollout_routed_experts")
    if routed is not None and not isinstance(routed, RoutedExperts):
        try:
            routed = RoutedExperts.from_array(_host(routed))
        except (TypeError, ValueError) as exc:
            raise ConversionError(
                "rollout_routed_experts", routed, f"is not [rows, layers, topk] ints: {exc}"
            ) from exc
    return Sample(
        index=attrs.get("index"),
        group_index=attrs.get("group_index"),
        rollout_id=attrs.get("rollout_id"),
        prompt=attrs.get("prompt", ""),
        tokens=tokens,
        response=attrs.get("response") or "",
        response_length=response_length,
        label=attrs.get("label"),
        reward=reward_value(attrs.get("reward")),
        loss_mask=loss_mask,
        rollout_log_probs=log_probs,
        status=status,
        weight_versions=[str(v) for v in weight_versions],
        metadata=metadata,
        session_id=attrs.get("session_id"),
        rollout_routed_experts=routed,
        teacher_log_probs=teacher,
    )


def _host(value: Any) -> Any:
    """A torch tensor (on any device) as a host array; anything else as it is."""
    detach = getattr(value, "detach", None)
    return detach().cpu().numpy() if callable(detach) else value


def copy_back(source: Any, sample: Sample) -> None:
    """After a hook that got `source` (from `to_slime(sample)`) returned something else (a reward,
    a verdict): keep the metadata and extra attributes it set, and the teacher log-probs (slime's
    on-policy distillation sets them in its reward post-processing)."""
    converted = from_slime(source)
    sample.metadata = converted.metadata
    sample.teacher_log_probs = converted.teacher_log_probs


def reward_value(value: Any) -> Any:
    """A reward as tether holds it: numbers (bools, numpy and torch scalars too) as float, dicts
    as they are; anything else is left for the contract check to name."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            scalar = item()
        except (ValueError, RuntimeError):
            return value
        if isinstance(scalar, numbers.Real):
            return float(scalar)
    return value


def _status(value: Any) -> SampleStatus:
    raw = value.value if isinstance(value, enum.Enum) else value
    try:
        return SampleStatus(raw)
    except ValueError:
        allowed = sorted(s.value for s in SampleStatus)
        raise ConversionError("status", value, f"is not one of {allowed}") from None


def _ints(field: str, values: Any) -> list[int]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise ConversionError(field, values, "must be a list of ints")
    out: list[int] = []
    for pos, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ConversionError(f"{field}[{pos}]", v, "must be an int")
        out.append(int(v))
    return out


def _floats(field: str, values: Any) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise ConversionError(field, values, "must be a list of floats")
    out: list[float] = []
    for pos, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise ConversionError(f"{field}[{pos}]", v, "must be a finite float")
        out.append(float(v))
    return out

"""`slime.rollout.filter_hub.base_types`: a dynamic filter's verdict, and calling a filter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class DynamicFilterOutput:
    """Keep a group or not, why not, and whether to keep it anyway when the batch would fall short."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """Drop a group unless it is kept, or kept-when-insufficient and the batch cannot fill without it."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


def call_dynamic_filter(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """The filter's verdict as a DynamicFilterOutput (a bare bool from an older filter is wrapped)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if isinstance(output, DynamicFilterOutput):
        return output
    keep = getattr(output, "keep", output)
    return DynamicFilterOutput(
        keep=bool(keep),
        reason=getattr(output, "reason", None),
        keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)),
    )


class MetricGatherer:
    """Counts dynamic-filter drops by reason for the rollout's metrics."""

    def __init__(self) -> None:
        self._drops: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{reason}": count for reason, count in self._drops.items()}

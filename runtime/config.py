"""Configuration slice for engine heartbeats and restarts (fault tolerance)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from tether.runtime.errors import ConfigError


class FaultToleranceConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Heartbeats against engines and what happens when one dies or hangs."""

    use_fault_tolerance: Annotated[
        bool, Meta(description="Heartbeat every engine; restart one that dies or hangs and requeue its work.")
    ] = False
    rollout_health_check_interval: Annotated[
        float, Meta(gt=0, description="Seconds between two heartbeats (/health_generate) to one engine.")
    ] = 10.0
    rollout_health_check_timeout: Annotated[
        float, Meta(gt=0, description="Seconds a heartbeat may take before the engine counts as hung.")
    ] = 5.0
    rollout_health_check_first_wait: Annotated[
        float,
        Meta(
            ge=0,
            description="Seconds an engine may take to become ready (0: 600); heartbeats start once it is.",
        ),
    ] = 300.0
    max_engine_restarts: Annotated[
        int, Meta(ge=0, description="Restarts allowed per engine before the run stops with an error.")
    ] = 3

    def __post_init__(self) -> None:
        if self.rollout_health_check_timeout > 10 * self.rollout_health_check_interval:
            raise ConfigError(
                "--rollout-health-check-timeout",
                self.rollout_health_check_timeout,
                f"is more than 10x --rollout-health-check-interval={self.rollout_health_check_interval}",
            )

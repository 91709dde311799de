"""Shared helpers for the rollout tests: configs (the engines are tests/conftest.py's fixtures)."""

from __future__ import annotations

from typing import Any

from tether.config import Config
from tether.rollout.config import DataConfig, RolloutConfig


def make_config(rollout: dict[str, Any] | None = None, data: dict[str, Any] | None = None) -> Config:
    return Config(rollout=RolloutConfig(**(rollout or {})), data=DataConfig(**(data or {})))

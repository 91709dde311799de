"""The engine keeps its own family groups (it imports nothing from the trainer): they must be the
trainer's, or one side would build a family the other reads differently."""

from __future__ import annotations

from tether.rollout.cpu_engine.modeling import families
from tether.train.model import hf_config


def test_the_engine_groups_families_as_the_trainer_does() -> None:
    assert families.MLA_MODEL_TYPES == hf_config.MLA_MODEL_TYPES
    assert families.DEEPSEEK_ROUTER_MODEL_TYPES == hf_config.DEEPSEEK_ROUTER_MODEL_TYPES

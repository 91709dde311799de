"""The calculator tool example: safe arithmetic, and observation tokens never entering the loss."""

from __future__ import annotations

import pytest

from tether.rollout.hooks.examples_calculator import CalculatorError, calculate, tool_answer
from tether.rollout.hooks.multi_turn import (
    MODEL,
    TOOL,
    append_model_tokens,
    append_observation,
    provenance_positions,
)
from tether.rollout.sample import Sample, SampleStatus, validate_sample


def test_calculator_evaluates_arithmetic_only() -> None:
    assert calculate("2 + 3 * (4 - 1)") == 11
    assert tool_answer("let me compute <calc>7/2</calc>") == "<result>3.5</result>"
    for bad in ("__import__('os')", "a + 1", "2 ** 1000", "1/0"):
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_observation_tokens_never_enter_the_loss() -> None:
    s = Sample(index=0, group_index=0, rollout_id=0, tokens=[1, 2, 3])
    append_model_tokens(s, [10, 11, 12], [-0.1, -0.2, -0.3], "<calc>1+1</calc>", "4")
    append_observation(s, [20, 21], "<result>2</result>")
    append_model_tokens(s, [13], [-0.4], "2", "4")
    s.status, s.reward = SampleStatus.COMPLETED, 1.0
    assert validate_sample(s) == 4  # only the four model tokens train
    tool = provenance_positions(s, TOOL)
    assert tool == [3, 4] and provenance_positions(s, MODEL) == [0, 1, 2, 5]
    mask, logps = s.loss_mask or [], s.rollout_log_probs or []
    assert all(mask[i] == 0 and logps[i] == 0.0 for i in tool)
    response = s.tokens[s.prompt_length :]
    assert [response[i] for i in tool] == [20, 21] and s.weight_versions == ["4"]
    assert logps[5] == -0.4  # the sampled log-prob stays with its token after the observation

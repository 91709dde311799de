"""The Sample contract: validate_sample / validate_group accept good samples and name every fault."""

from __future__ import annotations

import math

import pytest

from tether.rollout.sample import Sample, SampleContractError, validate_group, validate_sample


def good(**changes: object) -> Sample:
    sample = Sample(
        index=3,
        group_index=1,
        rollout_id=0,
        prompt="2+2=",
        tokens=[5, 6, 7, 8, 9],
        response="4",
        response_length=3,
        label="4",
        reward=1.0,
        loss_mask=[1, 0, 1],
        rollout_log_probs=[-0.1, 0.0, -2.0],
        status=Sample.Status.COMPLETED,
        weight_versions=["1"],
    )
    for key, value in changes.items():
        setattr(sample, key, value)
    return sample


def test_status_values_are_slimes() -> None:
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]


def test_good_sample_returns_trainable_positions() -> None:
    assert validate_sample(good()) == 2
    assert (
        validate_sample(
            good(status=Sample.Status.TRUNCATED, loss_mask=[1, 1, 1], rollout_log_probs=[-1.0] * 3)
        )
        == 3
    )
    assert validate_sample(good(rollout_id=0, reward={"acc": 1.0, "note": "ok"})) == 2


@pytest.mark.parametrize(
    ("changes", "field", "value"),
    [
        ({"tokens": []}, "tokens", "[]"),
        ({"tokens": [5, -1, 7, 8, 9]}, "tokens[1]", "-1"),
        ({"tokens": [5, 6, 7.0, 8, 9]}, "tokens[2]", "7.0"),
        ({"response_length": 0, "loss_mask": [], "rollout_log_probs": []}, "response_length", "0"),
        (
            {"response_length": 5, "loss_mask": [1] * 5, "rollout_log_probs": [-1.0] * 5},
            "response_length",
            "5",
        ),
        ({"loss_mask": [1, 0]}, "loss_mask", "[1, 0]"),
        ({"loss_mask": [1, 2, 1]}, "loss_mask[1]", "2"),
        ({"loss_mask": [0, 0, 0], "rollout_log_probs": [0.0, 0.0, 0.0]}, "loss_mask", "[0, 0, 0]"),
        ({"rollout_log_probs": [-0.1, 0.0]}, "rollout_log_probs", "[-0.1, 0.0]"),
        ({"rollout_log_probs": [-0.1, 0.0, math.nan]}, "rollout_log_probs[2]", "nan"),
        ({"rollout_log_probs": [0.5, 0.0, -1.0]}, "rollout_log_probs[0]", "0.5"),
        ({"rollout_log_probs": [-0.1, -0.3, -1.0]}, "rollout_log_probs[1]", "-0.3"),
        ({"reward": math.inf}, "reward", "inf"),
        ({"reward": None}, "reward", "None"),
        ({"reward": {"acc": math.nan}}, "reward['acc']", "nan"),
        ({"status": Sample.Status.ABORTED}, "status", "aborted"),
        ({"rollout_id": None}, "rollout_id", "None"),
    ],
)
def test_each_fault_names_field_and_value(changes: dict[str, object], field: str, value: str) -> None:
    with pytest.raises(SampleContractError) as info:
        validate_sample(good(**changes))
    assert info.value.field == field
    assert field in str(info.value) and value in str(info.value)
    assert isinstance(info.value, ValueError)


def test_vocab_bound_and_accepted_statuses() -> None:
    with pytest.raises(SampleContractError, match=r"tokens\[4\]=9 .*vocabulary size 9"):
        validate_sample(good(), vocab_size=9)
    aborted = good(status=Sample.Status.ABORTED)
    assert validate_sample(aborted, accepted_statuses=frozenset({Sample.Status.ABORTED})) == 2


def test_group_checks() -> None:
    group = [good(index=i) for i in range(4)]
    validate_group(group, 4)
    with pytest.raises(SampleContractError, match="wrong size"):
        validate_group(group, 3)
    with pytest.raises(SampleContractError, match="group_index=2"):
        validate_group([*group[:3], good(index=9, group_index=2)], 4)
    with pytest.raises(SampleContractError, match="index=1 appears twice"):
        validate_group([*group[:3], good(index=1)], 4)
    with pytest.raises(SampleContractError, match="prompt tokens differ"):
        validate_group([*group[:3], good(index=7, tokens=[4, 6, 7, 8, 9])], 4)


def test_scalar_reward_with_reward_key() -> None:
    sample = good(reward={"acc": 0.5, "fmt": 1.0})
    assert sample.scalar_reward("acc") == 0.5
    with pytest.raises(SampleContractError, match="--reward-key"):
        sample.scalar_reward(None)
    with pytest.raises(SampleContractError, match="no key 'x'"):
        sample.scalar_reward("x")

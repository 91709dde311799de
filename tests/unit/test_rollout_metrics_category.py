"""--log-reward-category: the share of each value of a dict reward's key, as slime logs it."""

from __future__ import annotations

import pytest

from tether.rollout.rollout_fn import reward_category_metrics
from tether.rollout.sample import Sample


def _sample(index: int, reward: object) -> Sample:
    return Sample(index=index, tokens=[1, 2], response_length=1, loss_mask=[1], reward=reward)  # type: ignore[arg-type]


def test_shares_per_value() -> None:
    samples = [_sample(i, {"score": 1.0, "cat": c}) for i, c in enumerate(["ok", "ok", "format", "ok"])]
    assert reward_category_metrics(samples, "cat") == {"error_cat/ok": 0.75, "error_cat/format": 0.25}
    assert reward_category_metrics([], "cat") == {}


@pytest.mark.parametrize("reward", [1.0, {"score": 1.0}])
def test_a_reward_without_the_key_is_refused_naming_the_sample(reward: object) -> None:
    with pytest.raises(ValueError, match=r"--log-reward-category=cat: sample 1 \(index 1\)"):
        reward_category_metrics([_sample(0, {"cat": "a"}), _sample(1, reward)], "cat")


def test_multi_turn_figures() -> None:
    from tether.rollout.rollout_fn import multi_turn_metrics

    a = Sample(index=0, tokens=[1, 2, 3, 4, 5], response_length=4, loss_mask=[1, 0, 0, 1], reward=1.0)
    b = Sample(index=1, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], reward=0.0)
    a.metadata["round_number"] = 3
    got = multi_turn_metrics([a, b], max_response_len=4)
    assert got["multi_turn/raw_response_length/response_length_mean"] == 3.0
    assert got["multi_turn/raw_response_length/response_length_clip_ratio"] == 0.5
    assert got["multi_turn/wo_obs_response_length/response_length_max"] == 2.0
    assert got["multi_turn/wo_obs_response_length/response_length_min"] == 2.0
    assert got["multi_turn/multi_turn_metric/round_number_mean"] == 3.0
    assert multi_turn_metrics([], 4) == {}

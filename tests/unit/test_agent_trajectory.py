"""slime.agent's TrajectoryManager on its own: branching, realign, rewrite-merge, shared turns
trained once, and the held prefix the adapters continue from."""

from __future__ import annotations

from tether.rollout.slime_api.agent.trajectory import TrajectoryManager, TurnRecord
from tether.rollout.slime_api.utils.types import Sample

SYS = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}


def reply(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_a_continued_conversation_is_one_sample_with_only_outputs_trained() -> None:
    m = TrajectoryManager()
    m.record_turn(
        "s",
        turn=TurnRecord([1, 2], [3, 4], "stop", [-0.1, -0.2]),
        prompt_messages=[SYS, USER],
        response_message=reply("a"),
    )
    tool = {"role": "tool", "content": "t"}
    held = m.held_prefix("s", [SYS, USER, reply("a"), tool])
    assert held == ([1, 2, 3, 4], 3)
    m.record_turn(
        "s",
        turn=TurnRecord([1, 2, 3, 4, 5], [6], "length", [-0.3]),
        prompt_messages=[SYS, USER, reply("a"), tool],
        response_message=reply("b"),
    )
    [s] = m.get_trajectory("s", base_sample=Sample(index=7), reward=2.0)
    assert s.tokens == [1, 2, 3, 4, 5, 6]
    assert s.loss_mask == [1, 1, 0, 1] and s.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    assert s.response_length == 4 and s.reward == 2.0 and s.metadata["truncated"] is True
    assert m.get_trajectory("s", base_sample=Sample(index=7)) == []


def test_two_branches_share_a_turn_that_trains_once() -> None:
    m = TrajectoryManager()
    m.record_turn(
        "s", turn=TurnRecord([1], [2], "stop", [-1.0]), prompt_messages=[USER], response_message=reply("a")
    )
    for tid, text in ((10, "x"), (20, "y")):
        msgs = [USER, reply("a"), {"role": "user", "content": text}]
        m.record_turn(
            "s",
            turn=TurnRecord([1, 2, tid], [tid + 1], "stop", [-0.5]),
            prompt_messages=msgs,
            response_message=reply(text),
        )
    first, second = m.get_trajectory("s", base_sample=Sample(index=0))
    assert first.loss_mask == [1, 0, 1] and second.loss_mask == [0, 0, 1]
    assert sum(first.loss_mask) + sum(second.loss_mask) == 3  # each generated token trains once


def test_drift_inside_the_last_response_realigns_and_earlier_drift_forks() -> None:
    m = TrajectoryManager()
    m.record_turn(
        "s",
        turn=TurnRecord([1], [2, 3], "stop", [-1.0, -1.0]),
        prompt_messages=[USER],
        response_message=reply("a"),
    )
    # The client re-rendered the response ([2, 9] instead of [2, 3]): realigned as context.
    m.record_turn(
        "s",
        turn=TurnRecord([1, 2, 9, 4], [5], "stop", [-2.0]),
        prompt_messages=[USER, reply("a"), USER],
        response_message=reply("b"),
    )
    [s] = m.get_trajectory("s", base_sample=Sample(index=0))
    assert s.tokens == [1, 2, 9, 4, 5] and s.loss_mask == [0, 0, 0, 1]
    m.record_turn(
        "f", turn=TurnRecord([1], [2], "stop", [-1.0]), prompt_messages=[USER], response_message=reply("a")
    )
    m.record_turn(
        "f",
        turn=TurnRecord([7, 2, 4], [5], "stop", [-2.0]),
        prompt_messages=[USER, reply("a"), USER],
        response_message=reply("b"),
    )
    assert [x.tokens for x in m.get_trajectory("f", base_sample=Sample(index=0))] == [[1, 2], [7, 2, 4, 5]]


def test_a_short_rewritten_assistant_message_merges_instead_of_leaving_a_dead_leaf() -> None:
    m = TrajectoryManager()
    m.record_turn(
        "s", turn=TurnRecord([1], [2], "stop", [-1.0]), prompt_messages=[USER], response_message=reply("a")
    )
    m.record_turn(
        "s",
        turn=TurnRecord([1, 8, 4], [5], "stop", [-1.0]),
        prompt_messages=[USER, reply("a "), USER],
        response_message=reply("b"),
    )
    [s] = m.get_trajectory("s", base_sample=Sample(index=0))
    assert s.tokens == [1, 8, 4, 5] and s.loss_mask == [1]  # the abandoned turn neither trains nor forks

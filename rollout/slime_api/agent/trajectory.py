"""`slime.agent.trajectory`: one agent session's turns as a message tree, linearised into Samples.

An adapter calls `record_turn` once per engine call with the chat messages it was asked to
continue and the turn the engine generated (`TurnRecord`: prompt and output token ids exactly as
the engine saw and sampled them). The messages are routed into a per-session tree: a prompt that
repeats a recorded path (system, user, the assistant message the model produced, the tool result,
...) walks down it, and a prompt that differs from the recorded history (a sub-agent's own
context, a compacted history) branches off where it differs. `get_trajectory` turns each
root-to-leaf path into Samples:

    first prompt | output 1 | what prompt 2 adds | output 2 | ...   (loss mask 0 | 1 | 0 | 1 ...)

A generated turn shared by several leaves trains once (on the first leaf); on the others it is
context (mask 0). Where a turn's prompt does not extend the tokens held before it (a client that
re-rendered history), a short divergence inside the last response is realigned to the prompt's
tokens as context, and anything else starts a new Sample (a fork). tether's adapters avoid the
divergence altogether: `held_prefix` gives the exact tokens of the recorded path a prompt
repeats, and the adapter sends the engine those tokens plus the template's rendering of only the
new messages, so every turn is a clean extension and nothing is re-tokenised.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.rollout.slime_api.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD = 1024
"""Responses at least this long are never realigned or merged away (slime's default)."""


@dataclass(frozen=True)
class TurnRecord:
    """One engine call: the prompt it was given and the tokens it generated, with their log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = field(default_factory=list)
    ill_formed: bool = False
    weight_version: str | None = None
    """The engine's weight version when it generated the turn (tether; None when not reported)."""


class MessageNode:
    """A node of a session's tree: one chat message (None at the root).

    `turn` is set on an assistant message the model generated in this session; every other node
    (system, user, tool, or an assistant message the client wrote itself) only routes."""

    def __init__(
        self,
        *,
        role: str | None = None,
        message: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        parent: MessageNode | None = None,
    ) -> None:
        self.role = role
        self.message = message
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.parent = parent
        self.children: list[MessageNode] = []
        self.turn: TurnRecord | None = None
        self.turn_index: int | None = None
        self.response_trained = False
        """Claimed by the first leaf that linearises this turn; later leaves keep it as context."""

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def add_child(self, child: MessageNode) -> MessageNode:
        child.parent = self
        self.children.append(child)
        return child

    def path_from_root(self) -> list[MessageNode]:
        """The nodes from the root's child down to this one."""
        path: list[MessageNode] = []
        node: MessageNode | None = self
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def leaves(self) -> Iterator[MessageNode]:
        if not self.children:
            yield self
            return
        for child in self.children:
            yield from child.leaves()


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DriftKind(enum.Enum):
    """How a turn's prompt relates to the tokens a Sample holds so far."""

    CLEAN = "clean"
    """The prompt starts with every held token: append what it adds."""
    REALIGN = "realign"
    """It differs only inside the last (short) response: replace that span by the prompt's, as context."""
    FORK = "fork"
    """Anything else: the turn starts a new Sample."""


class _SampleTokens:
    """The token sequence of one Sample being built from consecutive turns."""

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.weight_versions: list[str] = []
        self.last_response_start: int | None = None
        self.prompt_len = 0

    def classify(self, turn: TurnRecord) -> DriftKind:
        same = _common_prefix_len(self.tokens, turn.prompt_ids)
        if same == len(self.tokens):
            return DriftKind.CLEAN
        start = self.last_response_start
        if start is not None and same >= start and len(turn.output_ids) < self.fork_threshold:
            return DriftKind.REALIGN
        return DriftKind.FORK

    def append(self, turn: TurnRecord, kind: DriftKind, *, trained: bool) -> None:
        if kind is DriftKind.FORK:
            raise ValueError("a forking turn starts a new Sample; it cannot be appended")
        first = self.last_response_start is None
        if kind is DriftKind.REALIGN:
            assert self.last_response_start is not None
            cut = self.last_response_start
            del self.tokens[cut:], self.loss_mask[cut:], self.log_probs[cut:]
        context = turn.prompt_ids[len(self.tokens) :]
        self.tokens += context
        self.loss_mask += [0] * len(context)
        self.log_probs += [0.0] * len(context)
        self.last_response_start = len(self.tokens)
        self.tokens += turn.output_ids
        self.loss_mask += [int(trained)] * len(turn.output_ids)
        if trained and turn.output_log_probs:
            self.log_probs += [float(x) for x in turn.output_log_probs]
        else:
            self.log_probs += [0.0] * len(turn.output_ids)
        if turn.weight_version is not None:
            self.weight_versions.append(turn.weight_version)
        if first:
            self.prompt_len = len(turn.prompt_ids)

    def trains_anything(self) -> bool:
        return any(self.loss_mask[self.prompt_len :])

    def to_sample(self, base: Sample, metadata: dict[str, Any], max_tokens: int) -> Sample:
        end = min(len(self.tokens), max_tokens) if max_tokens else len(self.tokens)
        start = self.prompt_len
        return Sample(
            index=base.index,
            group_index=base.group_index,
            rollout_id=base.rollout_id if base.rollout_id is not None else base.index,
            prompt=base.prompt,
            label=base.label,
            tokens=self.tokens[:end],
            response_length=max(end - start, 0),
            loss_mask=self.loss_mask[start:end],
            rollout_log_probs=self.log_probs[start:end],
            weight_versions=list(self.weight_versions),
            reward=0.0,
            status=Sample.Status.COMPLETED,
            metadata=dict(metadata),
            session_id=base.session_id,
        )


class TrajectoryManager:
    """Every open session's message tree (one manager serves all sessions of an adapter)."""

    def __init__(self, *, fork_threshold_tokens: int | None = None) -> None:
        self._fork_threshold = (
            DEFAULT_FORK_THRESHOLD if fork_threshold_tokens is None else fork_threshold_tokens
        )
        self._trees: dict[str, MessageNode] = {}
        self._turns: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._trees

    def turn_count(self, sid: str) -> int:
        return self._turns.get(sid, 0)

    def held_prefix(
        self, sid: str, prompt_messages: Sequence[dict[str, Any]]
    ) -> tuple[list[int], int] | None:
        """The exact tokens through the last generated assistant message that `prompt_messages`
        repeats from this session's tree, and how many of the messages they cover; None when the
        prompt repeats no generated message (a new branch, rendered whole)."""
        root = self._trees.get(sid)
        if root is None:
            return None
        node, found = root, None
        for depth, message in enumerate(prompt_messages):
            child = self._child_matching(node, message)
            if child is None:
                break
            node = child
            if node.turn is not None:
                found = (node.turn, depth + 1)
        if found is None:
            return None
        turn, covered = found
        return [*turn.prompt_ids, *turn.output_ids], covered

    def record_turn(
        self,
        sid: str,
        *,
        turn: TurnRecord,
        prompt_messages: list[dict[str, Any]],
        response_message: dict[str, Any] | None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Route `prompt_messages` into the session's tree and hang the generated turn below them."""
        if not prompt_messages:
            logger.warning("record_turn(sid=%s): no prompt messages; the turn is not recorded", sid)
            return
        if turn.output_log_probs and len(turn.output_log_probs) != len(turn.output_ids):
            raise ValueError(
                f"turn.output_log_probs has {len(turn.output_log_probs)} entries for "
                f"{len(turn.output_ids)} output tokens"
            )
        node = self._trees.setdefault(sid, MessageNode())
        depth = 0
        while depth < len(prompt_messages):
            child = self._child_matching(node, prompt_messages[depth])
            if child is None:
                break
            node, depth = child, depth + 1
        node, depth = self._merge_rewritten_assistant(sid, node, prompt_messages, depth)
        for message in prompt_messages[depth:]:
            node = node.add_child(MessageNode(role=message.get("role"), message=message))
        leaf = node.add_child(MessageNode(role="assistant", message=response_message, metadata=metadata))
        leaf.turn = turn
        leaf.turn_index = self._turns.get(sid, 0) + 1
        self._turns[sid] = leaf.turn_index

    def get_trajectory(
        self,
        sid: str,
        *,
        base_sample: Sample,
        reward: float | dict[str, Any] = 0.0,
        extra_metadata: dict[str, Any] | None = None,
        max_sample_tokens: int = 0,
    ) -> list[Sample]:
        """The session's Samples, one or more per leaf, each with the whole `reward`; the session
        is consumed (a second call answers [])."""
        root = self._trees.pop(sid, None)
        self._turns.pop(sid, None)
        if root is None:
            return []
        samples: list[Sample] = []
        for leaf in root.leaves():
            if not leaf.is_root:
                samples += self._path_samples(
                    leaf.path_from_root(), base_sample, extra_metadata, max_sample_tokens
                )
        for sample in samples:
            sample.reward = reward
        return samples

    def drop_session(self, sid: str) -> None:
        self._trees.pop(sid, None)
        self._turns.pop(sid, None)

    # ----- internals -----

    @staticmethod
    def _child_matching(node: MessageNode, message: dict[str, Any]) -> MessageNode | None:
        role = message.get("role")
        return next((c for c in node.children if c.role == role and c.message == message), None)

    def _merge_rewritten_assistant(
        self, sid: str, node: MessageNode, messages: list[dict[str, Any]], depth: int
    ) -> tuple[MessageNode, int]:
        """A client that replays our last (short) assistant message slightly re-rendered would fork
        and leave the original as a dead leaf that still trains; instead the node takes the
        replayed message and stops training its turn, so only the live branch trains. Long
        responses, nodes with children and ambiguous mount points fork as usual."""
        if self._fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return node, depth
        assistants = [c for c in node.children if c.role == "assistant"]
        if len(assistants) != 1:
            if assistants:
                logger.warning(
                    "sid=%s: %d assistant branches where a rewrite lands; forking", sid, len(assistants)
                )
            return node, depth
        target = assistants[0]
        if target.children or target.turn is None or len(target.turn.output_ids) >= self._fork_threshold:
            return node, depth
        target.metadata["merged_rewrite"] = {
            "abandoned_turn_index": target.turn_index,
            "abandoned_response_tokens": len(target.turn.output_ids),
        }
        target.turn, target.turn_index, target.message = None, None, messages[depth]
        return target, depth + 1

    def _path_samples(
        self,
        path: list[MessageNode],
        base: Sample,
        extra_metadata: dict[str, Any] | None,
        max_tokens: int,
    ) -> list[Sample]:
        generated = [n for n in path if n.role == "assistant" and n.turn is not None]
        pieces: list[_SampleTokens] = []
        for node in generated:
            assert node.turn is not None
            trained = not node.response_trained
            node.response_trained = True
            kind = pieces[-1].classify(node.turn) if pieces else DriftKind.FORK
            if kind is DriftKind.FORK:
                pieces.append(_SampleTokens(self._fork_threshold))
                kind = DriftKind.CLEAN
            pieces[-1].append(node.turn, kind, trained=trained)
        metadata = {
            **(extra_metadata or {}),
            "truncated": bool(generated) and generated[-1].turn.finish_reason == "length",  # type: ignore[union-attr]
            "use_tool": any((n.message or {}).get("tool_calls") for n in generated),
            "ill_formed": any(n.turn.ill_formed for n in generated),  # type: ignore[union-attr]
        }
        return [p.to_sample(base, metadata, max_tokens) for p in pieces if p.trains_anything()]


__all__ = ["DriftKind", "MessageNode", "TrajectoryManager", "TurnRecord"]

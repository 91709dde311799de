"""The Sample contract: one trajectory, at token level, as the rollout hands it to the trainer.

Field names and meanings follow slime, so rollout hooks written for slime port unchanged.
Tokens come from the engine and are never re-tokenized; `loss_mask` and `rollout_log_probs`
cover only the response (the last `response_length` tokens).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

Reward = float | dict[str, Any]


class SampleStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class RoutedExperts(msgspec.Struct, frozen=True, kw_only=True):
    """The experts an MoE engine routed each token to (SGLang's `return_routed_experts`), for
    --use-rollout-routing-replay: int32 [rows, layers, topk], row t for token t of the sample.

    Kept as raw little-endian bytes so a Sample stays plain msgpack data (debug dumps, RPC);
    `array()` is the numpy view.
    """

    rows: int
    layers: int
    topk: int
    data: bytes

    @classmethod
    def from_array(cls, array: Any) -> RoutedExperts:
        """From anything numpy reads as a [rows, layers, topk] integer array (a tensor, lists)."""
        import numpy as np

        a = np.asarray(array)
        if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(
                f"routed experts must be an integer array [rows, layers, topk], got {a.dtype} {a.shape}"
            )
        rows, layers, topk = (int(x) for x in a.shape)
        return cls(rows=rows, layers=layers, topk=topk, data=np.ascontiguousarray(a, dtype="<i4").tobytes())

    def array(self) -> Any:
        """int32 [rows, layers, topk], read-only."""
        import numpy as np

        return np.frombuffer(self.data, dtype="<i4").reshape(self.rows, self.layers, self.topk)

    def merged(self, start_row: int, more: Any) -> RoutedExperts:
        """These rows up to `start_row`, then `more` ([rows', layers, topk]): what SGLang's
        `routed_experts_start_len` asks for when a turn returns only the rows from that token on."""
        import numpy as np

        new = np.asarray(more, dtype=np.int32)
        if start_row == 0:
            return RoutedExperts.from_array(new)
        if start_row > self.rows:
            raise ValueError(f"routed_experts_start_len={start_row} is past the {self.rows} rows held")
        return RoutedExperts.from_array(np.concatenate([self.array()[:start_row], new], axis=0))


class Sample(msgspec.Struct, kw_only=True):
    """One prompt plus one generated response, with everything the trainer needs from it."""

    Status: ClassVar[type[SampleStatus]] = SampleStatus

    index: int | None = None
    """Position of this sample in its rollout (unique within the rollout)."""
    group_index: int | None = None
    """The group (prompt) this sample belongs to; a group holds n_samples_per_prompt samples."""
    rollout_id: int | None = None
    """The trajectory (one agent execution) this sample belongs to: every segment of one
    multi-turn or partial rollout shares it, and the per-rollout loss mean divides by their
    trainable tokens together."""
    prompt: str | list[dict[str, Any]] = ""
    """The prompt as text, or as chat messages."""
    tokens: list[int] = msgspec.field(default_factory=list)
    """Prompt tokens followed by response tokens, exactly as the engine saw and produced them."""
    response: str = ""
    """The response text (for rewards and logs; the tokens are the truth)."""
    response_length: int = 0
    """Number of trailing tokens that are the response."""
    label: Any = None
    """The reference answer the reward compares against."""
    reward: Reward | None = None
    """Scalar reward, or a dict of rewards from which --reward-key selects one."""
    loss_mask: list[int] | None = None
    """Per response token: 1 if it trains, 0 if not (tool observations, masked segments)."""
    rollout_log_probs: list[float] | None = None
    """Per response token: the engine's log-probability of that token (0 where masked)."""
    status: SampleStatus = SampleStatus.PENDING
    """Where this sample is in its life."""
    weight_versions: list[str] = msgspec.field(default_factory=list)
    """Engine weight versions that generated the response, one per generation segment."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    """Free-form data carried with the sample (data-source metadata, hook state)."""
    session_id: str | None = None
    """Routes every turn of a multi-turn session to the same engine."""
    rollout_routed_experts: RoutedExperts | None = None
    """MoE models with --use-rollout-routing-replay: the experts the engine routed each token to,
    [len(tokens) - 1, layers, topk] (the last token is sampled, never routed)."""
    teacher_log_probs: list[float] | None = None
    """On-policy distillation with --opd-type sglang: per response token, the teacher's log-probability
    of that token (slime's field; set during the rollout by its on_policy_distillation hooks)."""

    def extend_response(
        self, tokens: Sequence[int], text: str, *, log_probs: Sequence[float] | None = None
    ) -> None:
        """Append response tokens: with `log_probs` they train (mask 1) with those log-probs;
        without, they are context only (mask 0, log-prob 0), e.g. a tool's observation."""
        if log_probs is not None and len(tokens) != len(log_probs):
            raise ValueError(f"{len(tokens)} tokens but {len(log_probs)} log-probs")
        self.tokens.extend(tokens)
        self.response += text
        self.response_length += len(tokens)
        trains = log_probs is not None
        self.loss_mask = [*(self.loss_mask or []), *([int(trains)] * len(tokens))]
        added = [float(x) for x in log_probs] if log_probs is not None else [0.0] * len(tokens)
        self.rollout_log_probs = [*(self.rollout_log_probs or []), *added]

    def update_routed_experts(self, flat: Any, start_row: int, layers: int, topk: int) -> None:
        """Take an engine's routed experts for this sample after its answer was appended: `flat`
        (int32, [rows, layers, topk] flattened) covers tokens `start_row` to the second-to-last
        (SGLang's `routed_experts` and `routed_experts_start_len`); rows before `start_row` are
        kept from the previous turn. Raises SampleContractError on a count that does not fit."""
        import numpy as np

        rows = len(self.tokens) - 1 - start_row
        values = np.asarray(flat, dtype=np.int32)
        if rows < 0 or values.size != rows * layers * topk:
            raise SampleContractError(
                "rollout_routed_experts",
                f"{values.size} entries",
                f"do not fit tokens={len(self.tokens)} from routed_experts_start_len={start_row} "
                f"({max(rows, 0)} rows) x layers={layers} x topk={topk}",
                sample_index=self.index,
            )
        new = values.reshape(rows, layers, topk)
        if start_row == 0:
            self.rollout_routed_experts = RoutedExperts.from_array(new)
            return
        held = self.rollout_routed_experts
        if held is None or held.rows < start_row or (held.layers, held.topk) != (layers, topk):
            got = None if held is None else f"[{held.rows}, {held.layers}, {held.topk}]"
            raise SampleContractError(
                "rollout_routed_experts",
                got,
                f"cannot be extended from routed_experts_start_len={start_row} (needs that many rows held)",
                sample_index=self.index,
            )
        self.rollout_routed_experts = held.merged(start_row, new)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward as one float; `reward_key` selects from a dict reward."""
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise SampleContractError("reward", self.reward, "is a dict; set --reward-key to choose one")
            if reward_key not in self.reward:
                raise SampleContractError("reward", self.reward, f"has no key {reward_key!r} (--reward-key)")
            return float(self.reward[reward_key])
        if self.reward is None:
            raise SampleContractError("reward", None, "is not set")
        return float(self.reward)


class SampleContractError(ValueError):
    """A Sample breaks the contract; the message names the field and the offending value."""

    def __init__(self, field: str, value: object, reason: str, *, sample_index: int | None = None) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        where = f"sample {sample_index}: " if sample_index is not None else ""
        super().__init__(f"{where}{field}={_short(value)} {reason}")


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


TRAINABLE = frozenset({SampleStatus.COMPLETED, SampleStatus.TRUNCATED})


def validate_sample(
    sample: Sample,
    accepted_statuses: frozenset[SampleStatus] = TRAINABLE,
    *,
    vocab_size: int | None = None,
) -> int:
    """Check `sample` against the contract; return its number of trainable positions.

    Raises SampleContractError naming the field and value at fault.
    """

    def fail(field: str, value: object, reason: str) -> SampleContractError:
        return SampleContractError(field, value, reason, sample_index=sample.index)

    if sample.rollout_id is None:
        raise fail("rollout_id", None, "must be set (0 is valid)")
    if not isinstance(sample.status, SampleStatus) or sample.status not in accepted_statuses:
        allowed = sorted(s.value for s in accepted_statuses)
        raise fail("status", sample.status, f"is not one of the accepted statuses {allowed}")
    tokens = sample.tokens
    if not isinstance(tokens, list) or not tokens:
        raise fail("tokens", tokens, "must be a non-empty list of token ids")
    for pos, tok in enumerate(tokens):
        if type(tok) is not int or tok < 0:
            raise fail(f"tokens[{pos}]", tok, "must be a non-negative int")
        if vocab_size is not None and tok >= vocab_size:
            raise fail(f"tokens[{pos}]", tok, f"must be below the vocabulary size {vocab_size}")
    n = sample.response_length
    if type(n) is not int or not 0 < n < len(tokens):
        raise fail("response_length", n, f"must satisfy 0 < response_length < len(tokens)={len(tokens)}")
    mask = sample.loss_mask
    if mask is None or len(mask) != n:
        got = None if mask is None else len(mask)
        raise fail("loss_mask", _short(mask), f"must have response_length={n} entries (has {got})")
    for pos, m in enumerate(mask):
        if m not in (0, 1) or type(m) is not int:
            raise fail(f"loss_mask[{pos}]", m, "must be 0 or 1")
    trainable = sum(mask)
    if trainable == 0:
        raise fail("loss_mask", _short(mask), "must contain at least one 1")
    logps = sample.rollout_log_probs
    if logps is None or len(logps) != n:
        got = None if logps is None else len(logps)
        raise fail("rollout_log_probs", _short(logps), f"must have response_length={n} entries (has {got})")
    for pos, (lp, m) in enumerate(zip(logps, mask, strict=True)):
        if not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 0:
            raise fail(f"rollout_log_probs[{pos}]", lp, "must be a finite float <= 0")
        if m == 0 and lp != 0:
            raise fail(f"rollout_log_probs[{pos}]", lp, "must be exactly 0 where loss_mask is 0")
    teacher = sample.teacher_log_probs
    if teacher is not None:
        if len(teacher) != n:
            raise fail(
                "teacher_log_probs",
                _short(teacher),
                f"must have response_length={n} entries (has {len(teacher)})",
            )
        for pos, lp in enumerate(teacher):
            if not isinstance(lp, int | float) or not math.isfinite(lp):
                raise fail(f"teacher_log_probs[{pos}]", lp, "must be a finite float")
    _check_reward(sample, fail)
    check_routed_experts(sample)
    return trainable


def check_routed_experts(sample: Sample, layers: int | None = None, topk: int | None = None) -> None:
    """`rollout_routed_experts`, when set, covers every token but the last, with non-negative expert
    ids (and `layers` x `topk` per token when given); raises SampleContractError."""
    routed = sample.rollout_routed_experts
    if routed is None:
        return

    def fail(value: object, reason: str) -> SampleContractError:
        return SampleContractError("rollout_routed_experts", value, reason, sample_index=sample.index)

    if not isinstance(routed, RoutedExperts):
        raise fail(type(routed).__name__, "must be a RoutedExperts (RoutedExperts.from_array(...))")
    shape = f"[{routed.rows}, {routed.layers}, {routed.topk}]"
    want_rows = len(sample.tokens) - 1
    if routed.rows != want_rows or routed.layers < 1 or routed.topk < 1:
        raise fail(shape, f"must have shape [len(tokens)-1={want_rows}, layers >= 1, topk >= 1]")
    if len(routed.data) != 4 * routed.rows * routed.layers * routed.topk:
        raise fail(shape, f"holds {len(routed.data)} bytes, not 4 per int32 entry")
    if (layers is not None and routed.layers != layers) or (topk is not None and routed.topk != topk):
        raise fail(shape, f"must have {layers} layers x top-{topk} per token (the model's)")
    if routed.rows and int(routed.array().min()) < 0:
        raise fail(shape, "holds a negative expert id")


def _check_reward(sample: Sample, fail: Any) -> None:
    reward = sample.reward
    if isinstance(reward, dict):
        for key, value in reward.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue  # non-numeric entries (explanations, labels) are allowed in a dict reward
            if not math.isfinite(value):
                raise fail(f"reward[{key!r}]", value, "must be finite")
        return
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise fail("reward", reward, "must be a finite number (or a dict of them)")


def validate_group(samples: Sequence[Sample], group_size: int) -> None:
    """Check that `samples` form one group: one group_index, one prompt, the size, no duplicate index."""
    if len(samples) != group_size:
        raise SampleContractError("group", len(samples), f"has the wrong size (expected {group_size})")
    if not samples:
        return
    first = samples[0]
    seen: set[int | None] = set()
    for s in samples:
        if s.group_index != first.group_index:
            raise SampleContractError(
                "group_index",
                s.group_index,
                f"differs within one group (expected {first.group_index})",
                sample_index=s.index,
            )
        if s.tokens[: s.prompt_length] != first.tokens[: first.prompt_length]:
            raise SampleContractError(
                "tokens",
                _short(s.tokens[: s.prompt_length]),
                "prompt tokens differ within one group",
                sample_index=s.index,
            )
        if s.index in seen:
            raise SampleContractError("index", s.index, "appears twice in one group", sample_index=s.index)
        seen.add(s.index)

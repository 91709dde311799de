"""`slime.utils.types`: slime's `Sample`, as hooks written for slime build and read it.

The fields, their order and defaults, the `Status` values and the methods hooks call
(`get_reward_value`, `append_response_tokens`, `to_dict` / `from_dict`,
`effective_response_length`) follow slime's API. tether trains text only: the multimodal fields
exist and stay empty, and the top-p replay fields exist and stay None; a Sample carrying any of
them is refused at the boundary
(`tether.rollout.slime_api.convert`), naming the field.

Hooks get these Samples converted from tether's own (`tether.rollout.sample.Sample`), and what
they return is converted back and checked against tether's Sample contract.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


def _int_list(values: Any) -> list[int]:
    """Token ids from a list, a tuple or anything with `.tolist()` (a tensor, an array)."""
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(v) for v in values]


def _float_list(values: Any) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


@dataclass
class _SpecInfo:
    """Speculative-decoding counters (slime's `Sample.SpecInfo`); tether's engines report none."""

    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @property
    def spec_accept_rate(self) -> float:
        draft = self.spec_draft_token_num
        return self.spec_accept_token_num / draft if draft else 0.0

    @property
    def spec_accept_length(self) -> float:
        verify = self.spec_verify_ct
        return self.completion_token_num / verify if verify else 0.0

    def add(self, meta_info: Mapping[str, Any]) -> None:
        self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num", 0))
        self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num", 0))
        self.spec_verify_ct += int(meta_info.get("spec_verify_ct", 0))
        self.completion_token_num += int(meta_info.get("completion_tokens", 0))

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> _SpecInfo:
        return _SpecInfo(**{f.name: int(data.get(f.name, 0)) for f in fields(_SpecInfo)})


@dataclass
class _PrefixCacheInfo:
    """Prompt tokens served from the engine's prefix cache (slime's `Sample.PrefixCacheInfo`)."""

    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        total = self.total_prompt_tokens
        return self.cached_tokens / total if total else 0.0

    def add(self, meta_info: Mapping[str, Any]) -> None:
        self.cached_tokens += int(meta_info.get("cached_tokens", 0) or 0)
        self.total_prompt_tokens += int(meta_info.get("prompt_tokens", 0) or 0)

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> _PrefixCacheInfo:
        return _PrefixCacheInfo(**{f.name: int(data.get(f.name, 0)) for f in fields(_PrefixCacheInfo)})


class _Status(enum.Enum):
    """Where a Sample is in its life (slime's `Sample.Status`; the values are tether's too)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_FINISH_STATUS = {"length": _Status.TRUNCATED, "abort": _Status.ABORTED, "stop": _Status.COMPLETED}


@dataclass
class Sample:
    """One prompt and its generated response, in slime's shape."""

    Status: ClassVar[type[_Status]] = _Status
    SpecInfo: ClassVar[type[_SpecInfo]] = _SpecInfo
    PrefixCacheInfo: ClassVar[type[_PrefixCacheInfo]] = _PrefixCacheInfo

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    """The trajectory this sample belongs to; None falls back to `index` (one sample each)."""
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    """Raw images/videos: always None on tether (text only)."""
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    """Top-p replay (slime with --rollout-top-p < 1): not supported by tether's trainer."""
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    """Routing replay for MoE: not supported by tether."""
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    """On-policy distillation (--opd-type sglang): the teacher's log-prob of each response token."""
    status: _Status = _Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: _SpecInfo = field(default_factory=_SpecInfo)
    prefix_cache_info: _PrefixCacheInfo = field(default_factory=_PrefixCacheInfo)

    # ----- serialisation (slime's debug dumps use these) -----
    def to_dict(self) -> dict[str, Any]:
        """Every attribute (hook-added ones too) as plain values; `status` as its string."""
        out = dict(vars(self))
        out["status"] = self.status.value
        out["spec_info"] = self.spec_info.to_dict()
        out["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Sample:
        """The inverse of `to_dict`: keys that are not fields become attributes."""
        values = dict(data)
        values["status"] = _Status(values.get("status", _Status.PENDING.value))
        values["spec_info"] = _SpecInfo.from_dict(values.get("spec_info") or {})
        values["prefix_cache_info"] = _PrefixCacheInfo.from_dict(values.get("prefix_cache_info") or {})
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in values.items() if k in names})
        for key, value in values.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    # ----- rewards -----
    def get_reward_value(self, args: Any) -> Any:
        """The reward, or its `args.reward_key` entry when a key is set."""
        key = getattr(args, "reward_key", None)
        if not key:
            return self.reward
        if not isinstance(self.reward, Mapping):
            raise TypeError(f"reward_key={key!r} is set but sample {self.index}'s reward is {self.reward!r}")
        return self.reward[key]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that train (all of them when there is no loss mask)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    # ----- building the response -----
    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Iterable[int] | None = None,
        log_probs: Iterable[float] | None = None,
        trainable: bool = True,
        meta_info: Mapping[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens and keep loss mask and log-probs aligned with them.

        Model tokens: `trainable=True` with the engine's `log_probs` (and its `meta_info`, which
        also sets the status from the finish reason and records the weight version). Tool or
        environment tokens: `trainable=False`, no log-probs; they get mask 0 and log-prob 0.
        """
        new_tokens = _int_list(tokens)
        new_logps = _float_list(log_probs)
        if new_logps is not None and len(new_logps) != len(new_tokens):
            raise ValueError(f"{len(new_logps)} log_probs for {len(new_tokens)} tokens")
        if new_tokens and trainable and new_logps is None:
            raise ValueError("trainable tokens need their rollout log_probs")
        if new_tokens and not trainable:
            if new_logps is not None:
                raise ValueError("tokens with trainable=False take no log_probs (they are context only)")
            new_logps = [0.0] * len(new_tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        # Lists grow in place, as in slime: hooks may hold on to `sample.loss_mask` and read it later.
        if new_tokens:
            self.tokens.extend(new_tokens)
            self.response_length = before + len(new_tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask.extend([1 if trainable else 0] * len(new_tokens))
        if new_logps is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        f"cannot append trainable log_probs: the {before} response tokens already there "
                        "have none"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs.extend(new_logps)
        if meta_info is not None and update_terminal_info:
            self._apply_finish(args, meta_info)
        self._check_lengths()

    def _apply_finish(self, args: Any, meta_info: Mapping[str, Any]) -> None:
        finish = meta_info.get("finish_reason")
        if not isinstance(finish, Mapping):
            return
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        version = meta_info.get("weight_version")
        if version is not None:
            self.weight_versions.append(str(version))
        status = _FINISH_STATUS.get(str(finish.get("type")))
        if status is not None:
            self.status = status

    def _check_lengths(self) -> None:
        n = self.response_length
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for response_length {n}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise ValueError(
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries for response_length {n}"
            )


@dataclass
class MultimodalType:
    """A kind of multimodal input (slime's API; tether trains text only)."""

    name: str
    placeholder: str


class MultimodalTypes:
    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((m for m in cls.all() if m.name == name), None)


SAMPLE_FIELDS: frozenset[str] = frozenset(f.name for f in fields(Sample))
"""slime's Sample field names (anything else a hook sets on a Sample is an extra attribute)."""

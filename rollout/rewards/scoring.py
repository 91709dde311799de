"""Rewards: the built-in verifiers (exact match, math answers, a remote reward model), custom reward
hooks per sample or per group, and the built-in dynamic-sampling filter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import msgspec

from tether.rollout.config import RolloutConfig, check_rm_type
from tether.rollout.hooks.calls import (
    HookError,
    flat_args,
    keep_slime_changes,
    load_function,
    maybe_await,
    slime_samples,
)
from tether.rollout.http_proxy import proxy_for
from tether.rollout.rewards.rules import boxed_content, rule_reward
from tether.rollout.rewards.types import BASE_TYPES, RULE_TYPES, split_rm_type
from tether.rollout.sample import Reward, Sample
from tether.rollout.slime_api.convert import reward_value, uses_slime_api
from tether.runtime.errors import ConfigError

if TYPE_CHECKING:
    import aiohttp


class DynamicFilterOutput(msgspec.Struct):
    """What a dynamic-sampling filter decides for one group (slime's shape)."""

    keep: bool
    reason: str | None = None


def _reward_value(sample: Sample, reward_key: str | None) -> float:
    return sample.scalar_reward(reward_key)


def check_reward_nonzero_std(args: Any, samples: Sequence[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group only when its rewards are not all equal (all right or all wrong teaches nothing)."""
    key = getattr(args, "reward_key", None)
    rewards = [_reward_value(s, key) for s in samples]
    if len(rewards) <= 1:
        return DynamicFilterOutput(keep=True)
    keep = max(rewards) - min(rewards) > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


# ----- exact match -----
def exact_match(response: str, label: Any) -> float:
    """1.0 when the response equals the label after trimming whitespace."""
    if label is None:
        return 0.0
    return 1.0 if " ".join(response.split()) == " ".join(str(label).split()) else 0.0


# ----- math answers -----
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`), with nested braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for pos in range(brace, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : pos]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a response: the last boxed expression, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical text of a math answer: no $, spaces, \\text{}, \\left/\\right; fractions as a/b."""
    s = answer.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:d|t)?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\(?:left|right|!|,|;|:)", "", s)
    s = s.replace("$", "").replace(" ", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    return s


def _as_number(s: str) -> Fraction | None:
    t = s.replace(",", "") if re.fullmatch(r"-?\d[\d,]*(\.\d+)?", s) else s
    t = t.rstrip("%")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(predicted: str, label: str) -> bool:
    a, b = normalize_answer(predicted), normalize_answer(label)
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    if na is None or nb is None:
        return False
    return math.isclose(float(na), float(nb), rel_tol=1e-6, abs_tol=1e-9)


def math_reward(response: str, label: Any) -> float:
    """1.0 when the response's final answer (boxed, else last number) equals the label's."""
    if label is None:
        return 0.0
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    label_text = str(label)
    label_answer = last_boxed(label_text) or label_text
    return 1.0 if math_equal(predicted, label_answer) else 0.0


# ----- the reward model behind --rm-type / --custom-rm-path -----
class RewardModel:
    """Scores samples as configured: --custom-rm-path (per sample, or per group with --group-rm) or --rm-type.

    Holds the HTTP session for a remote reward model; use as an async context manager.
    """

    def __init__(self, config: RolloutConfig, args: Any = None, *, request_timeout: float = 60.0) -> None:
        self._cfg = config
        self._args = flat_args(args) if args is not None else None
        self._timeout = request_timeout
        self._custom: Callable[..., Any] | None = None
        self._slime = False
        """The custom reward is written against slime's API: it gets (and may annotate) slime Samples."""
        if config.custom_rm_path:
            self._custom = load_function(config.custom_rm_path, "--custom-rm-path")
            self._slime = uses_slime_api(self._custom)
        elif config.rm_type is None:
            pass  # no reward configured: samples keep the reward a generate hook gave them
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RewardModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    @property
    def configured(self) -> bool:
        return self._custom is not None or self._cfg.rm_type is not None

    def _scores(self, sample: Sample) -> bool:
        """Whether this model gives the sample a reward (configured, or its metadata names an rm_type)."""
        return self.configured or sample_rm_type(sample) is not None

    async def score_group(self, samples: Sequence[Sample]) -> None:
        """Set `reward` on every sample of a group; outside --group-rm a sample that already holds one
        keeps it (slime: a reward computed during generation stands)."""
        if not self.configured:
            missing = [s.index for s in samples if s.reward is None and not self._scores(s)]
            if missing:
                raise HookError(
                    "--rm-type/--custom-rm-path",
                    f"no reward function is configured and samples {missing} have none",
                )
            for sample in samples:
                if self._scores(sample):  # the sample's metadata `rm_type` (slime's per-sample reward)
                    sample.reward = _check_reward(
                        f"rm_type {sample_rm_type(sample)}", await self._builtin(sample)
                    )
            return
        if self._cfg.group_rm:
            rewards = await self._group_rewards(samples)
            if len(rewards) != len(samples):
                raise HookError(
                    self._cfg.custom_rm_path or str(self._cfg.rm_type),
                    f"returned {len(rewards)} rewards for a group of {len(samples)}",
                    field="reward",
                )
            for sample, reward in zip(samples, rewards, strict=True):
                sample.reward = _check_reward(self._path, reward)
        else:
            for sample in samples:
                if sample.reward is None:  # slime keeps a reward the generate step already gave
                    sample.reward = _check_reward(self._path, await self.score(sample))

    async def reward_of(self, sample: Sample) -> Reward:
        """One sample's reward as the configured model gives it (the sample is not changed)."""
        if not self.configured:
            if not self._scores(sample):
                raise HookError(
                    "--rm-type/--custom-rm-path",
                    f"no reward function is configured for sample {sample.index}",
                )
            return _check_reward(f"rm_type {sample_rm_type(sample)}", await self._builtin(sample))
        return _check_reward(self._path, await self.score(sample))

    @property
    def _path(self) -> str:
        return self._cfg.custom_rm_path or f"--rm-type {self._cfg.rm_type}"

    async def score(self, sample: Sample) -> Reward:
        if self._custom is not None:
            if self._cfg.group_rm:
                return (await self._group_rewards([sample]))[0]
            if self._slime:
                given = slime_samples([sample])
                reward = await maybe_await(self._custom(self._args, given[0]))
                keep_slime_changes(self._path, given, [sample])
                return reward_value(reward)  # type: ignore[no-any-return]
            return await maybe_await(self._custom(self._args, sample))  # type: ignore[no-any-return]
        return await self._builtin(sample)

    async def _group_rewards(self, samples: Sequence[Sample]) -> list[Reward]:
        if self._custom is not None:
            given: list[Any] = slime_samples(samples) if self._slime else list(samples)
            result = await maybe_await(self._custom(self._args, given))
            if not isinstance(result, list):
                raise HookError(self._path, f"returned {type(result).__name__}; --group-rm expects a list")
            if self._slime:
                keep_slime_changes(self._path, given, samples)
                return [reward_value(r) for r in result]
            return result
        return [await self._builtin(s) for s in samples]

    async def _builtin(self, sample: Sample) -> Reward:
        """slime's order: the sample's metadata `rm_type`, else --rm-type."""
        kind = sample_rm_type(sample) or self._cfg.rm_type or ""
        base, boxed = split_rm_type(kind)
        if base == "remote_rm":
            return await self._remote(sample)
        if base == "exact_match":
            return exact_match(
                (boxed_content(sample.response) or "") if boxed else sample.response, sample.label
            )
        if base not in RULE_TYPES:
            raise HookError("--rm-type", f"unknown reward type {kind!r}; known: {', '.join(BASE_TYPES)}")
        return rule_reward(kind, sample.response, sample.label, sample.metadata)  # type: ignore[no-any-return]

    async def _remote(self, sample: Sample) -> Reward:
        import aiohttp  # a remote reward model's session only

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        if self._cfg.rm_url is None:
            raise HookError(
                "--rm-url", f"sample {sample.index} asks for rm_type remote_rm and --rm-url is unset"
            )
        url = self._cfg.rm_url
        body = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        proxy = proxy_for(url, self._cfg.http_proxy)
        async with self._session.post(
            url, data=msgspec.json.encode(body), headers=_JSON, proxy=proxy
        ) as resp:
            payload = await resp.read()
            if resp.status >= 400:
                raise HookError("--rm-url", f"{url} answered HTTP {resp.status}: {payload[:200]!r}")
        try:
            answer = msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise HookError("--rm-url", f"{url} answered non-JSON: {payload[:200]!r}") from exc
        return _check_reward("--rm-url", answer)


_JSON = {"Content-Type": "application/json"}


def sample_rm_type(sample: Sample) -> str | None:
    """The reward type a sample's metadata names (`rm_type`), checked like --rm-type; None without one."""
    kind = sample.metadata.get("rm_type") if isinstance(sample.metadata, dict) else None
    if not kind:
        return None
    try:
        check_rm_type(f"sample {sample.index} metadata rm_type", str(kind))
    except ConfigError as exc:
        raise HookError(f"sample {sample.index} metadata", str(exc), field="rm_type") from exc
    return str(kind).strip()


def _check_reward(path: str, value: object) -> Reward:
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        raise HookError(path, f"returned reward {value!r}; expected a number or a dict", field="reward")
    if isinstance(value, dict):
        return value
    if not math.isfinite(value):
        raise HookError(path, f"returned reward {value!r}; it must be finite", field="reward")
    return float(value)

"""`slime.rollout.rm_hub`: reward functions by slime's names, scored by slime's rules.

`async_rm(args, sample)` scores one slime Sample: with the sample's own `custom_rm_path`, else
--custom-rm-path, else by `rm_type` (the sample's `metadata["rm_type"]`, else --rm-type):
math, deepscaler, dapo, f1, gpqa, ifbench, random (see `tether.rollout.rewards.rules`), remote_rm
(POST {"prompt", "response", "label"} to --rm-url; its JSON answer is the reward), exact_match
(tether's whitespace-normalised equality), and boxed_<type> (<type> on the last \\boxed{} of the
response). `batched_async_rm(args, samples)` calls --custom-rm-path once with the whole list
(slime's batch mode), else scores each sample. Custom reward functions are loaded by
`slime.utils.misc.load_function(path)`, as slime does.

The scorers slime's package imports are here by the same names (`compute_score_dapo`,
`get_deepscaler_rule_based_reward`, `f1_score`, `compute_gpqa_reward`, `extract_boxed_answer`,
`grade_answer_verl`); `slime.rollout.rm_hub.ifbench` is not imported with the package, as in slime,
since it needs IFBench.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tether.rollout.hooks.calls import maybe_await
from tether.rollout.rewards.rules import rule_reward
from tether.rollout.rewards.scoring import exact_match
from tether.rollout.rewards.types import BASE_TYPES, RULE_TYPES, split_rm_type
from tether.rollout.slime_api.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from tether.rollout.slime_api.rollout.rm_hub.f1 import f1_score
from tether.rollout.slime_api.rollout.rm_hub.gpqa import compute_gpqa_reward
from tether.rollout.slime_api.rollout.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from tether.rollout.slime_api.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from tether.rollout.slime_api.rollout.rm_hub.math_utils import grade_answer_verl
from tether.rollout.slime_api.utils.http_utils import post
from tether.rollout.slime_api.utils.misc import _load_for_flag

__all__ = [
    "async_rm",
    "batched_async_rm",
    "compute_gpqa_reward",
    "compute_score_dapo",
    "extract_boxed_answer",
    "f1_score",
    "get_deepscaler_rule_based_reward",
    "grade_answer_verl",
    "remote_rm",
]

AVAILABLE = (*BASE_TYPES, "boxed_<type>")


async def remote_rm(args: Any, sample: Any, max_retries: int = 10) -> Any:
    """The reward the service at --rm-url answers for the sample's prompt, response and label."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("rm_type remote_rm needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(url, payload, max_retries=max_retries)


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """One sample's reward; see the module docstring for the order of the sources."""
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await maybe_await(_load_for_flag(path, "--custom-rm-path")(args, sample, **kwargs))
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = str(metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    if not rm_type:
        raise NotImplementedError("no reward type is set: pass --rm-type or --custom-rm-path")
    base, boxed = split_rm_type(rm_type)
    if base == "remote_rm":
        return await remote_rm(args, sample)
    if base == "exact_match":
        return exact_match(
            (extract_boxed_answer(sample.response) or "") if boxed else sample.response, sample.label
        )
    if base not in RULE_TYPES:
        raise NotImplementedError(
            f"rm_type {rm_type!r} is not a reward tether knows; available: {', '.join(AVAILABLE)}"
        )
    return rule_reward(rm_type, sample.response, sample.label, metadata)


async def batched_async_rm(args: Any, samples: Sequence[Any], **kwargs: Any) -> list[Any]:
    """Rewards for a list of samples: --custom-rm-path once over the list, else each by async_rm."""
    path = getattr(args, "custom_rm_path", None)
    if path:
        rewards = await maybe_await(_load_for_flag(path, "--custom-rm-path")(args, list(samples), **kwargs))
        return list(rewards)
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(async_rm(args, s, **kwargs)) for s in samples]
    return [t.result() for t in tasks]

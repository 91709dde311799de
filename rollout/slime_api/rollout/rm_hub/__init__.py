"""`slime.rollout.rm_hub`: reward functions by slime's names, scored by tether's verifiers.

`async_rm(args, sample)` scores one slime Sample: with the sample's own `custom_rm_path`, else
--custom-rm-path, else by `rm_type` (the sample's `metadata["rm_type"]`, else --rm-type):

    math        tether's math verifier (the last \\boxed{} answer, else the last number, against
                the label; 1 or 0)
    boxed_<t>   the contents of the response's last \\boxed{} scored by <t>
    remote_rm   POST {"prompt", "response", "label"} to --rm-url; its JSON answer is the reward
    exact_match tether's exact-match verifier (whitespace-normalised equality; 1.0 or 0.0)
    random      0 or 1 at random

slime's other rule-based rewards (deepscaler, dapo, f1, gpqa, ifbench) are not shipped by
tether; naming one raises NotImplementedError saying so. `batched_async_rm(args, samples)` calls
--custom-rm-path once with the whole list (slime's batch mode), else scores each sample.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from tether.rollout.hooks import load_function, maybe_await
from tether.rollout.rewards import exact_match, last_boxed, math_reward
from tether.rollout.slime_api.rollout.rm_hub.math_utils import extract_answer as extract_boxed_answer
from tether.rollout.slime_api.rollout.rm_hub.math_utils import grade_answer_verl
from tether.rollout.slime_api.utils.http_utils import post

__all__ = ["async_rm", "batched_async_rm", "extract_boxed_answer", "grade_answer_verl", "remote_rm"]

NOT_SHIPPED = ("deepscaler", "dapo", "f1", "gpqa", "ifbench")
AVAILABLE = ("math", "boxed_<type>", "remote_rm", "exact_match", "random")


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
        return await maybe_await(load_function(path, "--custom-rm-path")(args, sample, **kwargs))
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = str(metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    response = sample.response
    if rm_type.startswith("boxed_"):
        response = last_boxed(response) or ""
        rm_type = rm_type[len("boxed_") :]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type == "math":
        return 1 if math_reward(response, sample.label) == 1.0 else 0
    if rm_type == "exact_match":
        return exact_match(response, sample.label)
    if rm_type == "random":
        return random.randint(0, 1)
    if rm_type in NOT_SHIPPED:
        raise NotImplementedError(
            f"rm_type {rm_type!r} is one of slime's rule-based rewards that tether does not ship; "
            f"available: {', '.join(AVAILABLE)}, or set --custom-rm-path"
        )
    if rm_type:
        raise NotImplementedError(
            f"rm_type {rm_type!r} is not a reward tether knows; available: {', '.join(AVAILABLE)}"
        )
    raise NotImplementedError("no reward type is set: pass --rm-type or --custom-rm-path")


async def batched_async_rm(args: Any, samples: Sequence[Any], **kwargs: Any) -> list[Any]:
    """Rewards for a list of samples: --custom-rm-path once over the list, else each by async_rm."""
    path = getattr(args, "custom_rm_path", None)
    if path:
        rewards = await maybe_await(load_function(path, "--custom-rm-path")(args, list(samples), **kwargs))
        return list(rewards)
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(async_rm(args, s, **kwargs)) for s in samples]
    return [t.result() for t in tasks]

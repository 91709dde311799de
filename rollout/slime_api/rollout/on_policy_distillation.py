"""`slime.rollout.on_policy_distillation`: slime's hooks that fetch a teacher's log-probs during the
rollout (on-policy distillation with --use-opd --opd-type sglang).

A slime script wires them as

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://<teacher>/generate

`reward_func(args, sample)` asks the teacher server (SGLang's `/generate`, at --rm-url) to score
the sample's own tokens: nothing generated (`max_new_tokens` 0), the log-prob of every input token
returned (`return_logprob`, `logprob_start_len` 0); the server's JSON answer becomes the sample's
reward. `post_process_rewards(args, samples)` takes from each answer the log-probs of the response
tokens (`meta_info.input_token_logprobs`, one `[logprob, token_id, ...]` entry per input token,
the first without a log-prob) into `sample.teacher_log_probs`, and returns zero task rewards
(raw and processed): the learning signal is the distillation penalty the trainer adds to the
advantages (`tether.train.algorithms.opd`). A script with task rewards replaces this function with its own.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.slime_api.utils.http_utils import post

__all__ = ["post_process_rewards", "reward_func"]


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The teacher server's answer for the sample's tokens (with every input token's log-prob)."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError(
            "slime.rollout.on_policy_distillation.reward_func needs --rm-url (the teacher's /generate)"
        )
    if getattr(sample, "multimodal_inputs", None):
        raise ValueError(
            "on-policy distillation: the sample has multimodal inputs; tether trains on text only"
        )
    payload = {
        "input_ids": list(sample.tokens),
        "sampling_params": {
            "temperature": args.rollout_temperature,
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    return await post(url, payload)


def _response_log_probs(reward: Any, response_length: int, where: str) -> list[float]:
    """The teacher's log-probs of the last `response_length` input tokens, from its answer."""
    try:
        entries = reward["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: the reward is not a teacher server's /generate answer with "
            f"meta_info.input_token_logprobs (got {str(reward)[:200]})"
        ) from None
    scored = entries[1:]  # the first input token has no log-prob (nothing precedes it)
    if response_length > len(scored):
        raise ValueError(
            f"{where}: the teacher scored {len(scored)} tokens after the first, fewer than the "
            f"response's {response_length}"
        )
    return [float(entry[0]) for entry in scored[len(scored) - response_length :]]


def post_process_rewards(args: Any, samples: list[Any], **kwargs: Any) -> tuple[list[float], list[float]]:
    """Put each sample's teacher log-probs on it; zero task rewards (raw, processed)."""
    import torch  # slime's type for the field; the trainer's dependency

    for i, sample in enumerate(samples):
        where = f"sample {sample.index if sample.index is not None else i}"
        values = _response_log_probs(sample.get_reward_value(args), sample.response_length, where)
        sample.teacher_log_probs = torch.tensor(values, dtype=torch.float32)
    rewards = [0.0] * len(samples)
    return rewards, list(rewards)

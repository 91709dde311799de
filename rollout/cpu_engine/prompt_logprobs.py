"""Prompt scoring as SGLang reports it: `meta_info.input_token_logprobs` (and `input_top_logprobs`)
for a /generate request with `return_logprob` and `logprob_start_len` K >= 0.

SGLang's shape (0.5.23, scheduler_components/logprob_result_processor.py): one entry per prompt
token from position K on, `[logprob, token_id, text]`; entry j holds the log-prob of token K + j
given every token before it, except the first entry, whose log-prob is None even when K > 0 (the
forward pass from K yields the log-probs of tokens K + 1 .. L - 1, and SGLang puts None in front).
`input_top_logprobs` has one row per entry too: None first, then the top-k of the distribution
that predicted each later token. K == L gives empty lists; K > L is refused. The log-probs are
log_softmax of the raw logits (no temperature), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TopRow = list[tuple[float, int]]
"""The most likely (log-prob, token id) pairs at one position, best first."""


@dataclass(frozen=True)
class PromptScore:
    """The scored part of one prompt, entry j for prompt token start + j."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[TopRow | None] | None
    """Per entry, the `top_logprobs_num` most likely tokens (None unless they were asked for)."""


def check_start(start: int, prompt_len: int, where: str) -> str | None:
    """Why `start` (a logprob_start_len) is refused for a prompt of `prompt_len` tokens, or None."""
    if start < -1:
        return f"{where}={start}: must be -1 (log-probs of the output tokens only) or a prompt position >= 0"
    if start > prompt_len:
        # SGLang's words, aborting the request with 400.
        return (
            f"{where}={start} is higher than the number of input tokens {prompt_len}. "
            "Please use a smaller logprob_start_len."
        )
    return None


def wants_scoring(return_logprob: bool, start: int, prompt_len: int) -> bool:
    """Whether a request needs its prompt's logits: a prompt position to score from was given."""
    return return_logprob and 0 <= start < prompt_len


def score_prompt(prompt: list[int], start: int, logits: torch.Tensor, top_k: int) -> PromptScore:
    """Shape SGLang's input log-probs from `logits` [L - start, V]: row i is the model's output at
    prompt position start + i (it predicts token start + i + 1)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = prompt[start:]
    nxt = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    picked = logprobs[:-1].gather(1, nxt.view(-1, 1)).view(-1).tolist() if len(ids) > 1 else []
    values: list[float | None] = [None, *picked]
    top: list[TopRow | None] | None = None
    if top_k > 0:
        k = min(top_k, logprobs.shape[-1])
        best, best_ids = logprobs[:-1].topk(k, dim=-1)
        top = [None] + [
            list(zip(v, t, strict=True)) for v, t in zip(best.tolist(), best_ids.tolist(), strict=True)
        ]
    return PromptScore(token_ids=list(ids), logprobs=values, top=top)


__all__ = ["PromptScore", "TopRow", "check_start", "score_prompt", "wants_scoring"]

"""Chat turns made through an engine's OpenAI endpoint, laid end to end as one tether Sample.

Agent code (tau-bench's tool adapter, coding agents) talks to engines with an OpenAI client; RL
needs each turn's tokens and log-probs exactly as they were sampled. Ask for them the way
SGLang returns them, `logprobs=True` and `extra_body={"return_token_ids": True}` (each choice
then carries `prompt_token_ids`, `response_token_ids` and `logprobs.content[].logprob`; with
`"return_meta_info": True` also `meta_info.output_token_logprobs` as `[logprob, id, text]`),
keep each turn with `Turn.from_response`, and `sample_from_turns` builds the Sample:

    prompt of turn 1 | output 1 | what turn 2's prompt adds | output 2 | ...

Model outputs train (loss_mask 1, with the log-probs they were sampled with); what lies between
them (tool results, user text, the template's glue) is context (loss_mask 0, log-prob 0). Each
run is recorded as provenance (multi_turn.py), and each turn's weight version is kept.

A later turn's prompt must begin with everything before it, token for token. When a chat
template renders an earlier output differently from how it was sampled (re-tokenization drift:
other merges, a tool call re-serialized), `sample_from_turns` refuses with `TurnDrift`, naming
the turn and position, rather than train on tokens the model never produced. To avoid drift,
send the next turn's prompt yourself: `continuation_ids` is the tokens so far plus the template's
rendering of only the new messages, passed as `extra_body={"input_ids": ids}` (SGLang then skips
its own templating; the messages still drive stop strings and tool parsing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tether.rollout.hooks.multi_turn import append_model_tokens, append_observation
from tether.rollout.sample import Sample

PLACEHOLDER = "\u2063tether-turn-placeholder\u2063"
"""Stands for the last assistant message's body while the template renders what follows it."""


class TurnDrift(ValueError):
    """A turn's prompt does not continue the tokens before it (the template re-tokenized them)."""


class Turn(msgspec.Struct, kw_only=True, frozen=True):
    """One chat completion choice: its prompt and output exactly as the engine saw and sampled them."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_log_probs: list[float]
    text: str = ""
    """The output as text (content, or the raw text for a tool call); for logs and rewards."""
    finish_reason: str | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        if len(self.output_token_ids) != len(self.output_log_probs):
            raise ValueError(
                f"{len(self.output_token_ids)} output tokens but {len(self.output_log_probs)} log-probs"
            )

    @classmethod
    def from_response(cls, response: Any, choice: int = 0) -> Turn:
        """The turn in an OpenAI chat completion (a JSON dict, or the `openai` client's object)
        asked with `logprobs=True` and `return_token_ids` (or `return_meta_info`)."""
        body: Mapping[str, Any] = (
            response if isinstance(response, Mapping) else response.model_dump(warnings=False)
        )
        choices = body.get("choices") or []
        if not 0 <= choice < len(choices):
            raise ValueError(f"choice={choice}: the response has {len(choices)} choices")
        ch = choices[choice]
        meta = ch.get("meta_info") or {}
        prompt = ch.get("prompt_token_ids")
        output = ch.get("response_token_ids")
        entries = meta.get("output_token_logprobs")
        if output is None and entries is not None:
            output = [int(e[1]) for e in entries]
        if prompt is None or output is None:
            raise ValueError(
                "the response holds no token ids: ask with extra_body={'return_token_ids': True} "
                "(SGLang's choices[].prompt_token_ids / response_token_ids)"
            )
        if entries is not None:
            if [int(e[1]) for e in entries] != list(output):
                raise ValueError("meta_info.output_token_logprobs names other tokens than response_token_ids")
            log_probs = [float(e[0]) for e in entries]
        else:
            content = (ch.get("logprobs") or {}).get("content")
            if content is None:
                raise ValueError("the response holds no log-probs: ask with logprobs=True")
            log_probs = [float(e["logprob"]) for e in content]
        message = ch.get("message") or {}
        version = (body.get("metadata") or {}).get("weight_version", meta.get("weight_version"))
        return cls(
            prompt_token_ids=[int(t) for t in prompt],
            output_token_ids=[int(t) for t in output],
            output_log_probs=log_probs,
            text=str(message.get("content") or ""),
            finish_reason=ch.get("finish_reason"),
            weight_version=None if version is None else str(version),
        )


def sample_from_turns(
    turns: Sequence[Turn], *, sample: Sample | None = None, prompt: str | list[dict[str, Any]] = ""
) -> Sample:
    """One Sample holding `turns` in order (see the module docstring); fills `sample` if given
    (its tokens must be empty), else a new one with `prompt`. Raises TurnDrift where a turn's
    prompt does not start with every token before it."""
    if not turns:
        raise ValueError("no turns")
    out = sample if sample is not None else Sample(prompt=prompt)
    if out.tokens:
        raise ValueError("the sample already holds tokens")
    out.tokens = list(turns[0].prompt_token_ids)
    out.response_length = 0
    out.loss_mask, out.rollout_log_probs = [], []
    for k, turn in enumerate(turns):
        if k:
            have = out.tokens
            head = turn.prompt_token_ids[: len(have)]
            if head != have or len(turn.prompt_token_ids) < len(have):
                at = next((i for i, (a, b) in enumerate(zip(have, head, strict=False)) if a != b), len(head))
                raise TurnDrift(
                    f"turn {k}: its prompt does not continue the {len(have)} tokens before it (first "
                    f"difference at token {at}); the chat template re-tokenized an earlier turn. Send "
                    "the turn with extra_body={'input_ids': continuation_ids(...)}"
                )
            append_observation(out, turn.prompt_token_ids[len(have) :], "")
        append_model_tokens(out, turn.output_token_ids, turn.output_log_probs, turn.text, turn.weight_version)
    return out


def continuation_ids(
    tokenizer: Any,
    tokens: Sequence[int],
    new_messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """`tokens` (the conversation so far, ending with the model's last output) followed by the
    chat template's rendering of `new_messages` (tool results, the next user message) and the
    generation prompt: the next turn's prompt with no earlier token re-tokenized.

    The template renders [user, assistant(placeholder), *new_messages]; what follows the
    placeholder is the glue that closes the assistant's message plus the new messages. An
    end-of-sequence token the output already ends with (e.g. `<|im_end|>`) is not repeated."""
    if not tokens:
        raise ValueError("tokens: empty; the first turn's prompt is the template's own rendering")
    history = [{"role": "user", "content": "."}, {"role": "assistant", "content": PLACEHOLDER}]
    text = tokenizer.apply_chat_template(
        [*history, *(dict(m) for m in new_messages)],
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    at = text.rfind(PLACEHOLDER)
    if at == -1:
        raise ValueError("the chat template dropped the assistant message; cannot find where it ends")
    glue = text[at + len(PLACEHOLDER) :]
    last = int(tokens[-1])
    if last in set(tokenizer.all_special_ids):
        closing = tokenizer.convert_ids_to_tokens(last)
        if isinstance(closing, str) and glue.startswith(closing):
            glue = glue[len(closing) :]
    return [*tokens, *tokenizer.encode(glue, add_special_tokens=False)]


__all__ = ["Turn", "TurnDrift", "continuation_ids", "sample_from_turns"]

"""`slime.utils.mask_utils`: token ids and a loss mask for a whole chat, from the chat template.

`MultiTurnLossMaskGenerator(tokenizer, tokenizer_type).get_loss_mask(messages, tools)` returns
`(token_ids, loss_mask)`: 1 on the tokens of assistant messages (not on the generation header the
template puts before them), 0 elsewhere, and 0 on any message with `"step_loss_mask": 0`.

tether's generator works for any chat template that renders a conversation as the rendering of
its first messages followed by the rest (prefix-stable), which the Qwen and Llama style templates
do: each message's tokens are what it adds to the rendering of the messages before it, and an
assistant message's header is what `add_generation_prompt=True` adds. The `tokenizer_type`s
slime names (`qwen`, `qwen3`, `qwen3_5`, `distill_qwen`) are accepted; `distill_qwen` masks
only the last message, rendered after the chat-templated first message. A template that rewrites
earlier turns (dropping past reasoning, say) is refused with the message at which it diverges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TOKENIZER_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")


def get_response_lengths(loss_masks: Sequence[Sequence[int]]) -> list[int]:
    """Per mask: the length from its first 1 to its end (0 when it has no 1)."""
    out = []
    for mask in loss_masks:
        ones = [i for i, m in enumerate(mask) if m == 1]
        out.append(len(mask) - ones[0] if ones else 0)
    return out


class MultiTurnLossMaskGenerator:
    """See the module docstring."""

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen") -> None:
        if tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"tokenizer_type={tokenizer_type!r} is not one of {list(TOKENIZER_TYPES)}")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type

    def get_response_lengths(self, loss_masks: Sequence[Sequence[int]]) -> list[int]:
        return get_response_lengths(loss_masks)

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        generation: bool = False,
    ) -> list[int]:
        if not messages and not generation:
            return []
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
        if tools:
            kwargs["tools"] = tools
        text = self.tokenizer.apply_chat_template(list(messages), **kwargs)
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def get_loss_mask(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        if self.tokenizer_type == "distill_qwen":
            return self._distill(messages, tools)
        token_ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            full = self._render(messages[: i + 1], tools)
            if full[: len(token_ids)] != token_ids:
                raise ValueError(
                    f"the chat template renders messages[:{i + 1}] with a different beginning than "
                    f"messages[:{i}] (it rewrites earlier turns); no per-message loss mask can be cut from it"
                )
            added = full[len(token_ids) :]
            trains = message.get("role") == "assistant" and message.get("step_loss_mask", 1) == 1
            header = 0
            if trains:
                prompt = self._render(messages[:i], tools, generation=True)
                if prompt[: len(token_ids)] == token_ids and full[: len(prompt)] == prompt:
                    header = len(prompt) - len(token_ids)
            mask.extend([0] * header + [int(trains)] * (len(added) - header))
            token_ids = full
        return token_ids, mask

    def _distill(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], list[int]]:
        prompt = self._render(messages[:1], tools, generation=True)
        response = list(self.tokenizer.encode(str(messages[-1]["content"]), add_special_tokens=False))
        trains = messages[-1].get("step_loss_mask", 1) == 1
        return prompt + response, [0] * len(prompt) + [int(trains)] * len(response)

    def get_loss_mask_with_multimodal_alignment(
        self,
        messages: Sequence[dict[str, Any]],
        input_ids: list[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """The text loss mask, left-padded with 0 to `input_ids`' length (multimodal prompts are longer)."""
        text_messages = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = [
                    item.get("text", "") if isinstance(item, dict) else str(item)
                    for item in content
                    if isinstance(item, str) or (isinstance(item, dict) and item.get("type") == "text")
                ]
                message = {**message, "content": " ".join(parts)}
            text_messages.append(message)
        _, mask = self.get_loss_mask(text_messages, tools)
        if len(mask) > len(input_ids):
            raise ValueError(f"input_ids has {len(input_ids)} tokens, fewer than the text's {len(mask)}")
        return input_ids, [0] * (len(input_ids) - len(mask)) + mask

    def get_text_from_loss_mask(self, token_ids: Sequence[int], loss_masks: Sequence[int]) -> list[str]:
        """The decoded text of each run of trained (mask 1) tokens."""
        texts: list[str] = []
        run: list[int] = []
        for token, m in zip(token_ids, loss_masks, strict=False):
            if m == 1:
                run.append(token)
            elif run:
                texts.append(self.tokenizer.decode(run))
                run = []
        if run:
            texts.append(self.tokenizer.decode(run))
        return texts

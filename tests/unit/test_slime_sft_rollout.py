"""slime's SFT recipe: a record's messages stay messages without --apply-chat-template, and
`slime.rollout.sft_rollout` turns each into one trainable Sample (whole conversation, the loss mask
on the assistant's tokens), as slime's run-qwen3-4B-base-sft.sh uses it."""

from __future__ import annotations

import pytest
from test_slime_api_samples import _ChatTokenizer

from tether.rollout.data.source import DataError, render_prompt
from tether.rollout.slime_api.rollout.sft_rollout import sft_sample
from tether.rollout.slime_api.utils.mask_utils import MultiTurnLossMaskGenerator
from tether.rollout.slime_api.utils.processing_utils import load_processor
from tether.rollout.slime_api.utils.types import Sample

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 2*3?"},
    {"role": "assistant", "content": "6"},
]


def test_messages_stay_messages_without_the_chat_template() -> None:
    tok = _ChatTokenizer()
    prompt, tokens = render_prompt(MESSAGES, tok, apply_chat_template=False, where="r1")
    assert prompt == MESSAGES
    assert tok.decode(tokens) == tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    with pytest.raises(DataError, match="r2: prompt must be text or a list of messages"):
        render_prompt({"role": "user"}, tok, apply_chat_template=False, where="r2")


def test_an_sft_sample_trains_on_the_assistants_tokens_only() -> None:
    tok = _ChatTokenizer()
    gen = MultiTurnLossMaskGenerator(tok, tokenizer_type="qwen")
    sample = sft_sample(gen, Sample(index=7, prompt=list(MESSAGES)))
    assert tok.decode(sample.tokens) == tok.apply_chat_template(MESSAGES)
    # The response runs from the first assistant token to the end; the loss mask covers it exactly.
    assert len(sample.loss_mask) == sample.response_length
    trained = "".join(
        chr(t) for t, m in zip(sample.tokens[-sample.response_length :], sample.loss_mask, strict=True) if m
    )
    assert trained == "5</s>\n6</s>\n"
    assert sample.reward == 0
    with pytest.raises(ValueError, match="sample 8 has a str prompt"):
        sft_sample(gen, Sample(index=8, prompt="text"))
    with pytest.raises(ValueError, match="no assistant message"):
        sft_sample(gen, Sample(index=9, prompt=[{"role": "user", "content": "hi"}]))


def test_text_models_have_no_processor() -> None:
    assert load_processor("/nonexistent") is None

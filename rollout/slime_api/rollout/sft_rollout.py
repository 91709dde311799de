"""`slime.rollout.sft_rollout.generate_rollout`: supervised fine-tuning data as a rollout.

Each prompt record's messages (--input-key, kept as messages without --apply-chat-template) become
one Sample: the whole conversation's tokens, the response the span from the first trained token to
the end, the loss mask from `MultiTurnLossMaskGenerator` (--loss-mask-type), reward 0. Nothing is
generated, so it runs with --debug-train-only (no engines), as slime's SFT scripts do.
"""

from __future__ import annotations

from typing import Any

from tether.rollout.rollout_fn import current_context
from tether.rollout.slime_api.utils.mask_utils import MultiTurnLossMaskGenerator
from tether.rollout.slime_api.utils.processing_utils import load_tokenizer
from tether.rollout.slime_api.utils.types import Sample

_GENERATOR = "slime.rollout.sft_rollout.generator"


def _generator(args: Any) -> MultiTurnLossMaskGenerator:
    # One per rollout context (one per run): building a tokenizer takes seconds.
    ctx = current_context()
    generator = ctx.extensions.get(_GENERATOR)
    if generator is None:
        tokenizer = ctx.tokenizer or load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=args.loss_mask_type)
        ctx.extensions[_GENERATOR] = generator
    return generator


def sft_sample(generator: MultiTurnLossMaskGenerator, sample: Sample) -> Sample:
    """`sample` with its conversation as tokens, response length and loss mask (in place)."""
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(
            f"slime.rollout.sft_rollout: sample {sample.index} has a {type(messages).__name__} prompt; "
            "SFT needs the record's messages (--input-key naming a list of messages, without "
            "--apply-chat-template)"
        )
    tools = (sample.metadata or {}).get("tools")
    token_ids, loss_mask = generator.get_loss_mask(messages, tools=tools)
    if len(token_ids) != len(loss_mask):
        raise ValueError(
            f"sample {sample.index}: {len(token_ids)} tokens but a loss mask of {len(loss_mask)}"
        )
    response_length = generator.get_response_lengths([loss_mask])[0]
    if response_length == 0:
        raise ValueError(f"sample {sample.index}: the conversation has no assistant message to train on")
    sample.tokens = list(token_ids)
    sample.response_length = response_length
    sample.reward = 0
    sample.loss_mask = list(loss_mask[-response_length:])
    sample.status = Sample.Status.COMPLETED  # a whole conversation: complete training data
    # No engine sampled these tokens. tether's Sample contract carries the column on every training
    # sample; sft_loss never reads it (as the demo's supervised phase).
    sample.rollout_log_probs = [0.0] * response_length
    return sample


def generate_rollout(
    args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False
) -> list[list[Sample]]:
    """`args.rollout_batch_size` conversations from the data source, each a group of one Sample."""
    del rollout_id
    if evaluation:
        raise ValueError(
            "slime.rollout.sft_rollout.generate_rollout makes training data only, not evaluations"
        )
    generator = _generator(args)
    groups = data_buffer.get_samples(args.rollout_batch_size)
    for group in groups:
        if len(group) != 1:
            raise ValueError(
                f"slime.rollout.sft_rollout needs one sample per prompt (--n-samples-per-prompt 1), "
                f"got groups of {len(group)}"
            )
        sft_sample(generator, group[0])
    return [list(g) for g in groups]


__all__ = ["generate_rollout", "sft_sample"]

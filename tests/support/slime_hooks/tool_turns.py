"""Hooks written in slime's API, as a slime user would write them (no tether import): a two-turn
generate that calls a tool between the turns, a reward, a dynamic filter and a buffer filter.

The generate posts to the router slime's hooks know (`args.sglang_router_ip`/`_port`), appends the
tool's answer as untrained tokens, and records where they are in `metadata["tool_spans"]`. Every
hook appends one JSON line per call to the file named by $TETHER_TEST_HOOK_LOG.
"""

import json
import os

from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

TURN_TOKENS = 3


def _log(event, **fields):
    with open(os.environ["TETHER_TEST_HOOK_LOG"], "a") as fh:
        fh.write(json.dumps({"event": event, **fields}) + "\n")


def count_digits(text):
    """The tool: how many digits the model wrote."""
    return f" ={sum(c.isdigit() for c in text)};"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    # A partial sample from an earlier rollout starts again from its prompt.
    prompt_tokens = sample.tokens[: len(sample.tokens) - sample.response_length]
    sample.tokens, sample.response, sample.response_length = list(prompt_tokens), "", 0
    sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = None, None, []
    tool_spans = []
    for turn in range(2):
        payload = {
            "input_ids": sample.tokens,
            "sampling_params": {**sampling_params, "max_new_tokens": TURN_TOKENS},
            "return_logprob": True,
        }
        output = await post(url, payload)
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        sample.append_response_tokens(
            args,
            tokens=[item[1] for item in meta["output_token_logprobs"]],
            log_probs=[item[0] for item in meta["output_token_logprobs"]],
            trainable=True,
            meta_info=meta,
            text=output["text"],
        )
        if turn == 0:
            observation = count_digits(output["text"])
            obs_tokens = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
            start = sample.response_length
            sample.append_response_tokens(args, tokens=obs_tokens, trainable=False, text=observation)
            tool_spans.append([start, sample.response_length])
    sample.metadata["tool_spans"] = tool_spans
    sample.tool_calls = len(tool_spans)
    _log("generate", index=sample.index, status=sample.status.value, router_port=args.sglang_router_port)
    return sample


async def reward_func(args, sample: Sample, **kwargs):
    """Spread within a group: the model's own tokens (not the tool's) mod 5."""
    assert sample.tool_calls == 1, "the attribute set in generate rides along"
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    own = [tok for tok, trains in zip(response, sample.loss_mask, strict=True) if trains]
    _log("reward", index=sample.index)
    return (sum(own) % 5) / 4


def keep_spread(args, samples: list[Sample], **kwargs):
    output = check_reward_nonzero_std(args, samples, **kwargs)
    _log("filter", size=len(samples), keep=bool(output.keep))
    return output


def newest_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    taken = buffer[::-1][:num_samples]
    buffer[:] = [group for group in buffer if all(group is not t for t in taken)]
    _log(
        "buffer_filter",
        taken=len(taken),
        left=len(buffer),
        slime_samples=all(isinstance(s, Sample) for g in taken for s in g),
    )
    return taken

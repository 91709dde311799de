"""slime's two train-data hooks in its API:

* `convert` (--custom-convert-samples-to-train-data-path): slime's default conversion, except that
  rewards are each group's rewards minus the group mean (raw rewards kept) and the first response
  token of every sample does not train (loss mask 0).
* `postprocess` (--rollout-data-postprocess-path): after the log-prob passes and advantages, the last
  response token of every sample stops training too; it logs the keys it saw.

Calls are logged to $TETHER_TEST_HOOK_LOG.
"""

import json
import os

from slime.utils.types import Sample


def _log(event, **fields):
    with open(os.environ["TETHER_TEST_HOOK_LOG"], "a") as fh:
        fh.write(json.dumps({"event": event, **fields}) + "\n")


def convert(args, samples: list[Sample]):
    raw = [float(s.reward) for s in samples]
    by_group = {}
    for s, r in zip(samples, raw, strict=True):
        by_group.setdefault(s.group_index, []).append(r)
    means = {g: sum(v) / len(v) for g, v in by_group.items()}
    _log("convert", samples=len(samples))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [r - means[s.group_index] for s, r in zip(samples, raw, strict=True)],
        "raw_reward": raw,
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": [[0] + [1] * (s.response_length - 1) for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
    }


def postprocess(args, rollout_id, rollout_data):
    for mask in rollout_data["loss_masks"]:
        mask[-1] = 0
    _log(
        "postprocess",
        rollout_id=rollout_id,
        keys=sorted(rollout_data),
        samples=len(rollout_data["tokens"]),
        partition=rollout_data["partition"],
    )

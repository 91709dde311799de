"""`slime.rollout.forge_load.generate_rollout`: saved rollouts returned as if generated.

slime's memory-measurement mode: `--rollout-function-path slime.rollout.forge_load.generate_rollout
--load-forge-rollout-data PATH` trains on dumped rollouts while the engines, weight updates and
colocated offloading all run as in a real run (unlike --load-debug-rollout-data, which starts no
engines). PATH is a dump file that every rollout reuses, or a template with {rollout_id}; a
rollout with no file of its own falls back to rollout 0's, and an evaluation reads
`eval_<id>` files (template only) or evaluates nothing. The dumps are tether's
(--save-debug-rollout-data writes them): msgpack, never pickle, so slime's .pt dumps are refused
naming the file.
"""

from __future__ import annotations

import os
from typing import Any

from tether.rollout.debug_dump import DebugDumpError, dump_path, load_rollout
from tether.rollout.slime_api.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput

FLAG = "--load-forge-rollout-data"
ROLLOUT_FUNCTION = "slime.rollout.forge_load.generate_rollout"


def _dump_file(template: str, rollout_id: int, evaluation: bool) -> str | None:
    """The dump to read: this rollout's, else (training) rollout 0's; None when there is none."""
    if evaluation and "{rollout_id" not in template:
        return None  # a literal file is training data; it is not replayed as an evaluation
    key = f"eval_{rollout_id}" if evaluation else str(rollout_id)
    path = template.format(rollout_id=key) if "{rollout_id" in template else template
    if os.path.exists(path):
        return path
    if not evaluation and os.path.exists(fallback := os.fspath(dump_path(template, 0))):
        return fallback
    return None


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    del data_source  # nothing is drawn: the dump is the rollout
    template = getattr(args, "load_forge_rollout_data", None)
    if not template:
        raise DebugDumpError(f"{ROLLOUT_FUNCTION} needs {FLAG} (a dump file or a {{rollout_id}} template)")
    path = _dump_file(template, rollout_id, evaluation)
    if evaluation:
        if path is None:
            return RolloutFnEvalOutput(data={})
        groups = load_rollout(path, rollout_id).groups
        samples = [s for g in groups for s in g]
        return RolloutFnEvalOutput(
            data={
                "forge_eval": {
                    "rewards": [_reward(args, s) for s in samples],
                    "truncated": [s.status == s.Status.TRUNCATED for s in samples],
                    "samples": samples,
                }
            }
        )
    if path is None:
        raise DebugDumpError(f"{FLAG}={template!r}: no dump for rollout {rollout_id} and none for rollout 0")
    # The samples keep what they were saved with (rollout ids, rewards): a forged rollout trains
    # exactly what the dump holds.
    return RolloutFnTrainOutput(samples=load_rollout(path, rollout_id).groups)


def _reward(args: Any, sample: Any) -> float:
    key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    reward = sample.reward
    if key and isinstance(reward, dict):
        reward = reward.get(key)
    return float(reward) if reward is not None else 0.0


__all__ = ["generate_rollout"]

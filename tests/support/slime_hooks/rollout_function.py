"""A whole rollout function in slime's API, synchronous as slime's are: it draws groups from the
data source, generates and rewards them with slime's `generate_and_rm_group` (run through
`slime.utils.async_utils.run`), and returns slime Samples, in the newer shape
(`RolloutFnTrainOutput`) on even rollouts and the older bare list on odd ones. The reward is slime's
group variant (`--group-rm`). Calls are logged to $TETHER_TEST_HOOK_LOG.
"""

import asyncio
import json
import os

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.types import Sample


def _log(event, **fields):
    with open(os.environ["TETHER_TEST_HOOK_LOG"], "a") as fh:
        fh.write(json.dumps({"event": event, **fields}) + "\n")


async def group_reward(args, samples: list[Sample], **kwargs):
    """One reward per sample, computed over the group (slime's batch mode): rank by token sum."""
    sums = [sum(s.tokens[-s.response_length :]) for s in samples]
    order = sorted(range(len(sums)), key=lambda i: (sums[i], i))
    rewards = [0.0] * len(samples)
    for rank, i in enumerate(order):
        rewards[i] = rank / max(1, len(samples) - 1)
    _log("group_reward", size=len(samples))
    return rewards


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert not evaluation, "this test configures no evaluation"
    groups = data_source.get_samples(args.rollout_batch_size)
    state = GenerateState(args)

    async def generate_all():
        return await asyncio.gather(
            *(generate_and_rm_group(args, group, dict(state.sampling_params)) for group in groups)
        )

    done = run(generate_all())
    _log(
        "rollout",
        rollout_id=rollout_id,
        groups=len(done),
        statuses=sorted({s.status.value for g in done for s in g}),
    )
    if rollout_id % 2 == 0:
        return RolloutFnTrainOutput(samples=done, metrics={"custom/groups": len(done)})
    return done

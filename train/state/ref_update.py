"""--ref-update-interval: every N rollouts the reference model's weights become the actor's
(slime/backends/megatron_utils/actor.py: after rollout r trains, when (r + 1) % N == 0).

Both models come from the same builder, so each rank copies its own shard, tensor by tensor on
the device, at any TP/PP. A resumed run starts from the reference as loaded (--ref-load or the
HF checkpoint), as in slime, whose reference copy lives only in memory too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.train.state.weight_copies import copy_weights


def ref_update_due(interval: int | None, rollout_id: int) -> bool:
    """Whether the reference takes the actor's weights once rollout `rollout_id` has trained."""
    return interval is not None and (rollout_id + 1) % interval == 0


def update_reference(actor_chunks: Sequence[Any], ref_chunks: Sequence[Any]) -> None:
    """The reference model's weights become the actor's (this rank's shard of both)."""
    copy_weights(actor_chunks, ref_chunks)

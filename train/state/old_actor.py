"""--keep-old-actor: slime's old_actor, the weights the rollout engines generated with, for the
old log-probs (slime/backends/megatron_utils/actor.py).

slime keeps host copies of the actor: "old_actor" from the start weights, and, with
--update-weights-interval 1, "rollout_actor" too. Each weight update then moves a queue: with
interval 1 old_actor takes rollout_actor's weights and rollout_actor the actor's (so old_actor is
one update behind the engines: the weights the one-step-off async loop generated the next rollout
with); with a longer interval old_actor takes the actor's weights. Every old log-prob pass runs
with old_actor's weights swapped in, and the actor's own come back after it.

Here rollout_actor is made at the first update with interval 1: until then it would equal
old_actor (both are the start weights), so old_actor stands in for it and no copy is spent when
the interval is longer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from tether.train.state.weight_copies import WeightCopy, swapped_in


class OldActor:
    """The old actor's weights of one rank, and the queue that moves them at each weight update."""

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.old = WeightCopy(chunks)
        self.rollout: WeightCopy | None = None
        self._stash: WeightCopy | None = None

    def restart(self, chunks: Sequence[Any]) -> None:
        """The actor's weights were loaded (a checkpoint, an HF directory): they are the start weights."""
        self.old.store(chunks)
        self.rollout = None

    def after_weight_update(self, chunks: Sequence[Any], update_weights_interval: int) -> None:
        """The engines now serve the actor's current weights: move the queue as slime does."""
        if update_weights_interval == 1:
            if self.rollout is not None:
                self.old.store_from(self.rollout)
            else:  # the first update: rollout_actor would hold the start weights, which old holds
                self.rollout = WeightCopy(chunks)
                return
            self.rollout.store(chunks)
        else:
            self.old.store(chunks)

    @contextlib.contextmanager
    def active(self, chunks: Sequence[Any]) -> Iterator[None]:
        """The actor's chunks compute with the old actor's weights inside the block."""
        if self._stash is None:
            self._stash = WeightCopy(chunks)
        with swapped_in(chunks, self.old, self._stash):
            yield

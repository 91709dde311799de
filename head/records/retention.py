"""The head's side of checkpoint retention: prune --save after each checkpoint, record deletions.

The policy and the crash-safe deletion live in `tether.train.checkpoint.retention`; this adds
what the head owns: the paths --load / --ref-load resolved to when the run started (protected
for the whole run), a thread for the blocking rmtree, and one `checkpoint_deleted` event per
deleted checkpoint in events.jsonl.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tether.config import Config
from tether.records.run_dir import RunDir

if TYPE_CHECKING:
    from tether.train.checkpoint.retention import DeletedCheckpoint

# The policy's modules are imported where used: they import torch (tether.train.checkpoint.load_save),
# ~1.5 s of the head's start-up that a run without --keep-last/--keep-every never needs.

log = logging.getLogger(__name__)


class CheckpointRetention:
    """Create it at the run's start, before any load or save; `prune()` after each save."""

    def __init__(self, cfg: Config, run_dir: RunDir) -> None:
        alg = cfg.algorithm
        self.run_dir = run_dir
        self.save_dir = Path(alg.save) if alg.save is not None else None
        self.keep_last = alg.keep_last_checkpoints
        self.keep_every = alg.keep_every_checkpoints
        self.enabled = self.save_dir is not None and (
            self.keep_last is not None or self.keep_every is not None
        )
        # Resolved now: once the run saves into a --load that is also --save, "what --load names"
        # would move to the newest checkpoint; the one the run started from is what stays protected.
        self.protected: set[Path] = set()
        if self.enabled:
            from tether.train.checkpoint.retention import resolve_protected

            self.protected = resolve_protected([alg.load, alg.ref_load])

    async def prune(self) -> list[DeletedCheckpoint]:
        """Delete what the policy no longer keeps; never raises for a filesystem error (the run
        goes on with more checkpoints on disk, and says so in events.jsonl)."""
        if not self.enabled or self.save_dir is None:
            return []
        from tether.train.checkpoint.layout import critic_checkpoint_dir
        from tether.train.checkpoint.retention import prune_checkpoints

        # The PPO critic's checkpoints (`--save/critic/iter_N`) follow the actor's policy.
        critic = critic_checkpoint_dir(self.save_dir)
        deleted: list[DeletedCheckpoint] = []
        for root in (self.save_dir, *([critic] if critic.is_dir() else [])):
            try:
                deleted += await asyncio.to_thread(
                    prune_checkpoints,
                    root,
                    keep_last=self.keep_last,
                    keep_every=self.keep_every,
                    protected=self.protected,
                )
            except OSError as exc:
                log.warning("pruning checkpoints under %s failed: %s", root, exc)
                self.run_dir.event("checkpoint_prune_failed", save=str(root), error=str(exc))
        for gone in deleted:
            self.run_dir.event(
                "checkpoint_deleted", path=str(gone.path), step=gone.step, interrupted=gone.interrupted
            )
        return deleted

"""Checkpoint retention: which complete checkpoints under --save a long run keeps; deleting the rest.

The policy (with neither flag every checkpoint is kept, as in Megatron and slime):

    --keep-last-checkpoints N   keep the newest N complete checkpoints
    --keep-every-checkpoints K  also keep iter_S when (S+1) % K == 0. S is the rollout id of the
                                step the checkpoint ends with, and an interval save happens when
                                (S+1) % --save-interval == 0, so K counts steps the same way:
                                --save-interval 20 --keep-every-checkpoints 100 keeps
                                iter_0000099, iter_0000199, ...

Whatever the flags, a prune never deletes a `.tmp` directory (a save in progress) or anything
else that is not a complete checkpoint, the newest complete checkpoint, the one the tracker names,
the protected paths (what --load / --ref-load resolved to at start), nor the checkpoint a resume
would load now (`select_checkpoint`: the first candidate whose files validate) or anything newer
than it. So a checkpoint is deleted only once a newer one is complete and verified, and at least
one loadable checkpoint always remains.

slime's data-position file of a deleted checkpoint (`rollout/global_dataset_state_dict_S.pt`)
is deleted with it. Deletion is crash-safe: `iter_X` is first renamed to `iter_X.deleting`, which the loader's
`iter_NNNNNNN` pattern does not match, the directory is fsynced, and only then is the tree
removed. A crash part-way leaves a `.deleting` directory that no load considers; the next prune
removes it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from tether.runtime.files.atomic_file import fsync_path
from tether.train.checkpoint.layout import iteration_of
from tether.train.checkpoint.load_save import (
    complete_checkpoints,
    find_checkpoint,
    iter_dir_name,
    select_checkpoint,
)

log = logging.getLogger(__name__)

DELETING_SUFFIX = ".deleting"
_DELETING = re.compile(r"^iter_(\d{7})" + re.escape(DELETING_SUFFIX) + "$")


@dataclass(frozen=True)
class DeletedCheckpoint:
    """One checkpoint a prune removed."""

    path: Path  # the checkpoint's own name, iter_XXXXXXX (gone now)
    step: int
    interrupted: bool = False  # it was a `.deleting` leftover of a prune that a crash cut short


def kept_by_policy(steps: Sequence[int], *, keep_last: int | None, keep_every: int | None) -> set[int]:
    """The steps the flags keep out of `steps` (all of them when neither flag is set)."""
    if keep_last is None and keep_every is None:
        return set(steps)
    ordered = sorted(steps)
    kept = set(ordered[-keep_last:]) if keep_last else set()
    if keep_every:
        kept.update(s for s in ordered if (s + 1) % keep_every == 0)
    return kept


def resolve_protected(load_dirs: Collection[str | Path | None]) -> set[Path]:
    """What --load / --ref-load name, resolved now (at the run's start): each path itself and the
    checkpoint a load from it would choose. When --load is the --save directory this protects the
    checkpoint the run resumed from, not whichever is newest when a prune runs."""
    protected: set[Path] = set()
    for load_dir in load_dirs:
        if load_dir is None:
            continue
        protected.add(Path(load_dir))
        # Named by the user: the run loads its checkpoints even without digests (trusted input).
        chosen, _skipped = select_checkpoint(load_dir, named=True)
        if chosen is not None:
            protected.add(chosen)
    return protected


def prune_checkpoints(
    save_dir: str | Path,
    *,
    keep_last: int | None,
    keep_every: int | None,
    protected: Collection[Path] = (),
) -> list[DeletedCheckpoint]:
    """Delete the complete checkpoints under `save_dir` that the policy no longer keeps, oldest
    first, and any `.deleting` leftovers; returns what was deleted. Blocking (rmtree of large
    trees): the head runs it in a thread. Run by one process at a time per directory."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    deleted = _remove_leftovers(root)
    if keep_last is None and keep_every is None:
        return deleted
    complete = complete_checkpoints(root)
    if len(complete) < 2:
        return deleted
    # The checkpoint a resume would load now, verified; nothing at or after it is deleted.
    anchor, _skipped = select_checkpoint(root)
    if anchor is None:
        log.warning("no checkpoint under %s validates; deleting none", root)
        return deleted
    anchor_step = iteration_of(anchor)
    if anchor_step is None:  # the tracker names `release/`: not a checkpoint this run wrote
        log.warning("%s's tracker names %s; deleting none", root, anchor)
        return deleted
    keep = kept_by_policy(complete, keep_last=keep_last, keep_every=keep_every)
    keep.add(complete[-1])
    named = find_checkpoint(root)  # the one the tracker names (or the newest complete one)
    named_step = None if named is None else iteration_of(named)
    if named_step is not None:
        keep.add(named_step)
    shielded = {_real(p) for p in protected}
    doomed = [
        step
        for step in complete
        if step < anchor_step and step not in keep and _real(root / iter_dir_name(step)) not in shielded
    ]
    if not doomed:
        return deleted
    # Rename all first, then one fsync: from then on no load can pick any of them, even after a crash.
    renamed: list[tuple[int, Path]] = []
    for step in doomed:
        src = root / iter_dir_name(step)
        dst = src.with_name(src.name + DELETING_SUFFIX)
        try:
            if dst.exists():  # a leftover that could not be removed above
                shutil.rmtree(dst)
            os.rename(src, dst)
        except OSError as exc:
            log.warning("cannot delete checkpoint %s: %s", src, exc)
            continue
        renamed.append((step, dst))
    if renamed:
        fsync_path(root)
    for step, dst in renamed:
        if _rmtree(dst):
            _remove_slime_data_state(root, step)
            deleted.append(DeletedCheckpoint(root / iter_dir_name(step), step))
    return deleted


def _remove_leftovers(root: Path) -> list[DeletedCheckpoint]:
    """Finish the deletions a crash interrupted (`iter_X.deleting` directories)."""
    done: list[DeletedCheckpoint] = []
    for entry in sorted(root.iterdir()):
        match = _DELETING.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and _rmtree(entry):
            step = int(match.group(1))
            _remove_slime_data_state(root, step)
            done.append(DeletedCheckpoint(root / iter_dir_name(step), step, interrupted=True))
    return done


def _remove_slime_data_state(root: Path, step: int) -> None:
    """slime's data-position file of a deleted checkpoint goes with it (the name
    `tether.rollout.data.slime_state` writes; only a resume of that step reads it)."""
    try:
        (root / "rollout" / f"global_dataset_state_dict_{step}.pt").unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove slime's data state of step %d under %s: %s", step, root, exc)


def _rmtree(path: Path) -> bool:
    try:
        shutil.rmtree(path)
    except OSError as exc:  # already invisible to loads; the next prune tries again
        log.warning("cannot remove %s (the next prune retries): %s", path, exc)
        return False
    return True


def _real(path: Path) -> str:
    return os.path.realpath(path)

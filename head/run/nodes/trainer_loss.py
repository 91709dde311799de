"""A node holding trainer ranks lost mid-run: the run ends at its last complete checkpoint.

Megatron's process groups cannot lose a member and go on, so the step under way cannot finish.
The trainer pool notices — the supervisor's `node_lost` for a node of its torchrun jobs, or a
rank call that failed while such a node stops answering — and raises TrainerNodeLost; leaving
the pool stops the surviving ranks by signal (asked to exit, a rank would first wait for a
collective that never completes). The run then ends here (`end_run`): a `failed` event naming
the node and the last complete checkpoint, the steps trained after that checkpoint recorded
as discarded (the next attempt trains them again), and exit status TRAINER_NODE_LOST_EXIT,
which bin/slurm/tether.sbatch answers with a requeue (it runs with --auto-resume). A save the
loss interrupted stays an `iter_N.tmp` directory the tracker never names
(tether.train.checkpoint.load_save), so the previous checkpoint stays the latest.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tether.records.progress import RunProgress
from tether.records.run_dir import RunDir
from tether.runtime.errors import NodeLost, find_exception
from tether.runtime.process.supervisor import LOCAL, ManagedProcess, Supervisor
from tether.train.checkpoint import layout

# EX_TEMPFAIL (sysexits.h): the run can go on from its checkpoint once the node is back or replaced.
TRAINER_NODE_LOST_EXIT = 75


class TrainerNodeLost(NodeLost):
    """A node holding trainer ranks is lost: the trainer job cannot finish its step."""

    def __init__(self, node: str, reason: str, jobs: Sequence[str]) -> None:
        super().__init__(node, reason)
        self.jobs = list(jobs)

    def __str__(self) -> str:
        jobs = ", ".join(self.jobs)
        return f"node {self.node!r}, which holds trainer ranks ({jobs}), is lost ({self.reason})"

    def __reduce__(self) -> tuple[object, ...]:
        return (TrainerNodeLost, (self.node, self.reason, self.jobs))


class LosesNodes(Protocol):
    """A trainer pool, as the run's end asks it which of its nodes was lost."""

    def lost_node(self) -> TrainerNodeLost | None: ...


def _remote(procs: Iterable[ManagedProcess]) -> dict[str, list[str]]:
    """Node → the jobs on it, for the nodes other than the head's (whose loss ends the head too)."""
    nodes: dict[str, list[str]] = {}
    for proc in procs:
        if proc.node != LOCAL:
            nodes.setdefault(proc.node, []).append(proc.name)
    return nodes


def lost_node(sup: Supervisor, procs: Iterable[ManagedProcess]) -> TrainerNodeLost | None:
    """The first node of `procs` the supervisor counts lost now, or None."""
    states = sup.node_states()
    for node, jobs in _remote(procs).items():
        state = states.get(node)
        if state is not None and state["state"] == "lost":
            return TrainerNodeLost(node, str(state["reason"]), jobs)
    return None


async def confirm_lost_node(sup: Supervisor, procs: Iterable[ManagedProcess]) -> TrainerNodeLost | None:
    """The node of `procs` that is lost, asked now: a rank call just failed, and a peer rank's
    node that went away explains it (a surviving rank sees only a broken collective). Each
    node's agent is pinged; one that does not answer gets the heartbeats' verdict, within
    their tolerance. A failure with every node answering is the rank's own: None."""
    nodes = _remote(procs)
    reasons = await asyncio.gather(*(sup.node_loss(node) for node in nodes))
    for (node, jobs), reason in zip(nodes.items(), reasons, strict=True):
        if reason is not None:
            return TrainerNodeLost(node, reason, jobs)
    return None


def find_lost(exc: BaseException, pools: Sequence[LosesNodes]) -> TrainerNodeLost | None:
    """The trainer node loss that ended the run: raised by a pool, or (the supervisor's report of
    the lost job's exit came first) a node of a pool's jobs that is lost now."""
    found = find_exception(exc, TrainerNodeLost, causes=True)
    if found is not None:
        return found
    for pool in pools:
        lost = pool.lost_node()
        if lost is not None:
            return lost
    return None


def last_checkpoint(save: str | None) -> Path | None:
    """The checkpoint a resume from --save would load first (complete: renamed into place)."""
    return layout.first_candidate(Path(save)) if save is not None else None


async def end_run(lost: TrainerNodeLost, save: str | None, run_dir: RunDir, progress: RunProgress) -> int:
    """Record and report the run's end at its last complete checkpoint; the exit status."""
    checkpoint = await asyncio.to_thread(last_checkpoint, save)
    step = layout.iteration_of(checkpoint) if checkpoint is not None else None
    if checkpoint is None:
        where = "no checkpoint was saved (--save unset)" if save is None else f"no checkpoint in {save}"
        then = "a new run starts from --hf-checkpoint"
    else:
        where = f"the last complete checkpoint is {checkpoint}"
        then = f"--auto-resume with --save {save} resumes from it"
    if save is not None:
        # The model the next attempt starts from holds no step after the checkpoint.
        dropped = await asyncio.to_thread(
            run_dir.discard_steps_after, -1 if step is None else step, reason=f"node {lost.node} lost"
        )
        if dropped:
            run_dir.event(
                "steps_discarded", steps=dropped, resumed_from=step, reason=f"node {lost.node} lost"
            )
    message = f"{lost}: the run stops; {where}; {then}"
    run_dir.event(
        "failed",
        process=f"node {lost.node}",
        node=lost.node,
        jobs=lost.jobs,
        checkpoint=None if checkpoint is None else str(checkpoint),
        checkpoint_step=step,
        error=message,
    )
    progress.message(f"trainer node {lost.node} lost; stopped at {checkpoint or 'no checkpoint'}")
    print(f"tether run: {message}", file=sys.stderr, flush=True)
    return TRAINER_NODE_LOST_EXIT

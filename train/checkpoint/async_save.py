"""--async-save: a checkpoint's torch_dist files written in the background, finalised later.

`start_save` does what must happen at the step boundary, on every rank: the sharded state dict
(the save's content is fixed now), the common state and each rank's RNG state, and hands the
tensor files to megatron.core's async machinery (`dist_checkpointing.save(...,
async_sharded_save=True)` scheduled on an `AsyncCallsQueue`): a process forked now writes them
from a copy-on-write image of this moment (on GPUs Megatron first stages the tensors to host),
so training goes on and changes nothing the writer sees.

`finalize` (collective) waits for the writer, runs dist_checkpointing's finalisation (the
`.metadata` index, `metadata.json`), then what every save ends with (`checkpoint.finish_save`):
RNG files, digests, run state, the rename of `iter_N.tmp` to `iter_N` and only then the tracker.
Until then nothing names the new checkpoint, so a crash before `finalize` leaves the previous
checkpoint as the one a resume loads (and the `.tmp` directory is never loaded). The trainer
calls it before the next save, before the next weight update and at shutdown (slime finalises
before the next save and at the run's last one).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.train.checkpoint.load_save import (
    CONTENT_METADATA,
    RngState,
    RunState,
    begin_save,
    capture_rng,
    finish_save,
    save_state,
)
from tether.train.model.build import Actor
from tether.train.model.megatron_cpu import quiet_megatron_imports

log = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """A checkpoint whose files a background writer is writing; `finalize` completes it."""

    root: Path
    tmp: Path
    final: Path
    state: RunState
    rng: RngState
    call_idx: int


def _gated(gate: Any, write: Any, *args: Any, **kwargs: Any) -> Any:
    gate.wait()
    return write(*args, **kwargs)


class AsyncCheckpointer:
    """One rank's background checkpoint writes: it owns the Megatron `AsyncCallsQueue` (made on
    the first async save) that forks a writer per save and finalises them in order.

    `write_gate` (tests only): a fork-context Event each writer waits on before writing, so a
    test sees the step boundary pass while the checkpoint's files are not written yet.
    """

    def __init__(self, *, write_gate: Any = None) -> None:
        self.write_gate = write_gate
        self._queue: Any = None

    def _calls(self) -> Any:
        if self._queue is None:
            with quiet_megatron_imports():
                from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)  # a writer forked per save (Megatron's default)
        return self._queue

    def start_save(
        self, actor: Actor, save_dir: str | Path, state: RunState, *, save_optim: bool = True
    ) -> PendingSave:
        """Begin checkpoint `iter_{state.step}` and return once its writer runs in the
        background. Collective over every rank."""
        with quiet_megatron_imports():
            from megatron.core import dist_checkpointing

        root, tmp, final = begin_save(save_dir, state.step)
        sharded = save_state(actor, state, save_optim=save_optim)
        request = dist_checkpointing.save(
            sharded, str(tmp), content_metadata=dict(CONTENT_METADATA), async_sharded_save=True
        )
        rng = capture_rng()  # the RNG as at this step boundary, written at finalisation
        if self.write_gate is not None and request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(_gated, self.write_gate, request.async_fn))
        call_idx = self._calls().schedule_async_request(request)
        log.info("checkpoint %s: writing in the background", final)
        return PendingSave(root=root, tmp=tmp, final=final, state=state, rng=rng, call_idx=call_idx)

    def finalize(self, pending: PendingSave) -> Path:
        """Wait for the writer and complete the checkpoint (renamed into place, then the
        tracker). Collective over every rank; raises on every rank when a writer failed (the
        `.tmp` directory then stays behind, never loaded, and the previous checkpoint stays
        current)."""
        done = self._calls().maybe_finalize_async_calls(blocking=True)
        if pending.call_idx not in done:
            raise RuntimeError(f"checkpoint {pending.final}: its background write was not finalised ({done})")
        return finish_save(pending.root, pending.tmp, pending.final, pending.state, pending.rng)

"""slime's data-position file beside the checkpoints, read on resume and written at each save.

slime's RolloutDataSource saves its position at every checkpoint as
`{--save}/rollout/global_dataset_state_dict_{rollout_id}.pt` (torch.save of a dict) and, on
resume, loads `{--load}/rollout/global_dataset_state_dict_{start_rollout_id - 1}.pt`, the
iteration the trainer loaded. Its keys map one to one onto tether's `DataSourceState`:

    slime               tether                meaning
    epoch_id            epoch                 passes over the prompts begun
    sample_offset       offset                prompts of this epoch's order drawn
    sample_group_index  next_group_index      the next group's index
    sample_index        next_sample_index     the next sample's index
    metadata            (none)                slime's unused dict, written empty

Both draw lazily: an epoch ends with offset == number of prompts and the next draw starts the
next epoch. Without --rollout-shuffle the order is the file's, so the same position names the
same next prompt in both tools; with it each tool shuffles with its own generator, so the
position (how far into which epoch) carries over and the order within an epoch does not.
Groups tether keeps in its buffer (partial rollouts, groups drawn ahead) have no place in
slime's file (slime does not save its buffer either): a run resumed from this file starts them
over from the next fresh prompt.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from tether.rollout.data.source import DataError, DataSourceState
from tether.runtime.files.atomic_file import write_bytes_atomic

log = logging.getLogger(__name__)

STATE_DIR = "rollout"
_KEYS = {  # slime key -> DataSourceState field
    "epoch_id": "epoch",
    "sample_offset": "offset",
    "sample_group_index": "next_group_index",
    "sample_index": "next_sample_index",
}


def state_path(root: str | Path, rollout_id: int) -> Path:
    """slime's file for the checkpoint of `rollout_id` under checkpoint root `root`."""
    return Path(root) / STATE_DIR / f"global_dataset_state_dict_{rollout_id}.pt"


def to_slime(state: DataSourceState) -> dict[str, Any]:
    """tether's position as slime's RolloutDataSource saves its own."""
    out: dict[str, Any] = {slime: int(getattr(state, ours)) for slime, ours in _KEYS.items()}
    out["metadata"] = {}
    return out


def from_slime(
    saved: Mapping[str, Any], num_prompts: int, *, where: str = "slime's data state"
) -> DataSourceState:
    """slime's saved position as tether's, over `num_prompts` prompts (missing keys are 0, as
    slime's load reads them). DataError names the file and key of a value that cannot be one."""
    fields: dict[str, int] = {}
    for slime, ours in _KEYS.items():
        value = saved.get(slime, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataError(f"{where}: {slime}={value!r} is not a count")
        fields[ours] = value
    if fields["offset"] > num_prompts:
        raise DataError(
            f"{where}: sample_offset={fields['offset']} is past the {num_prompts} prompts of --prompt-data "
            "(was it saved over other data?)"
        )
    return DataSourceState(
        num_prompts=num_prompts,
        epoch=fields["epoch"],
        offset=fields["offset"],
        next_group_index=fields["next_group_index"],
        next_sample_index=fields["next_sample_index"],
    )


def write_state(root: str | Path, rollout_id: int, position: Mapping[str, Any]) -> Path | None:
    """Write slime's file for the checkpoint of `rollout_id` from tether's saved position (the
    data source's `state_dict` as builtins); nothing when the run has no data source (an empty
    position), as slime writes nothing without its global dataset. Atomic."""
    if not position:
        return None
    import torch

    state = msgspec.convert(position, DataSourceState)
    if state.buffer:
        log.info(
            "slime's data state for step %d leaves out %d buffered group(s): its format has no buffer",
            rollout_id,
            len(state.buffer),
        )
    data = io.BytesIO()
    torch.save(to_slime(state), data)
    path = state_path(root, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, data.getvalue())
    return path


def read_state(root: str | Path, rollout_id: int, num_prompts: int) -> DataSourceState | None:
    """The position slime saved beside the checkpoint of `rollout_id` under `root`, as tether's;
    None when there is no such file (slime then starts the data from the beginning too)."""
    path = state_path(root, rollout_id)
    if not path.is_file():
        return None
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)  # plain ints and dicts only
    except Exception as exc:  # an unpickling error can be of many types
        raise DataError(f"{path}: not slime's data state: {type(exc).__name__}: {exc}") from None
    if not isinstance(saved, Mapping):
        raise DataError(f"{path}: not slime's data state (a {type(saved).__name__}, not a dict)")
    return from_slime(saved, num_prompts, where=str(path))

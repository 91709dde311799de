"""`slime.rollout.data_source`: the data source interface rollout functions see, and `pop_first`.

On tether a rollout function gets tether's data source, wrapped to speak slime's Samples
(`tether.rollout.slime_api.bridge.SlimeDataSource`, a `DataSource` here). slime's own
implementations read prompts with slime's dataset loader; tether builds its data source from
--prompt-data itself, so constructing them is refused with a message saying so.
"""

from __future__ import annotations

import abc
from typing import Any, NoReturn


class DataSource(abc.ABC):
    """What a rollout function may call on its `data_source` argument."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """`num_samples` groups of Samples (buffered ones first)."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Any]]) -> None:
        """Put groups back (into the buffer)."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Save the position (tether saves it with each checkpoint itself)."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Load the position (tether restores it on resume itself)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Prompts in the data."""


class _BuiltByTether:
    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{type(self).__name__}: tether builds the data source from --prompt-data itself; a rollout "
            "function gets it as its `data_source` argument"
        )


class RolloutDataSource(_BuiltByTether):
    """slime's prompt-file data source; see the module docstring."""


class RolloutDataSourceWithBuffer(_BuiltByTether):
    """slime's data source with a buffer; see the module docstring."""


def pop_first(
    args: Any, rollout_id: int | None, buffer: list[list[Any]], num_samples: int
) -> list[list[Any]]:
    """The default buffer filter: the oldest `num_samples` groups, removed from the buffer."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken

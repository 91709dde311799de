"""`slime.rollout.data_source`: the data source interface, slime's prompt-file data sources, `pop_first`.

On tether a rollout function gets tether's data source, wrapped to speak slime's Samples
(`tether.rollout.slime_api.bridge.SlimeDataSource`, a `DataSource` here). `RolloutDataSource` and
`RolloutDataSourceWithBuffer` are slime's classes with slime's behaviour, for --data-source-path
classes that subclass them (tether's `HookDataSource` drives them as slime's rollout manager
does): built as `cls(args)`, they read `args.prompt_data` with tether's prompt reader (the keys,
chat template, tools and length limit of tether's own data source), keep slime's position
(`epoch_id`, `sample_offset`, `sample_group_index`, `sample_index`, `metadata`), shuffle each epoch
with slime's permutation (Python's `random` seeded with `rollout_seed + epoch`) under
--rollout-shuffle, hand out deep copies of each prompt's Sample (no tokens: the prompt is tokenized
when generated, so a subclass may rewrite it), and `save`/`load` that position in slime's file,
`{args.save|args.load}/rollout/global_dataset_state_dict_{rollout_id}.pt`.

Naming slime's `RolloutDataSourceWithBuffer` itself in --data-source-path (or nothing) runs
tether's own data source instead, which shuffles with its own generator.
"""

from __future__ import annotations

import abc
import copy
import io
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tether.rollout.slime_api.utils.types import Sample

log = logging.getLogger(__name__)


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


class PromptDataset:
    """slime's `Dataset` as its data sources use it: `samples` (this epoch's order of the prompt
    Samples), `origin_samples` (the file's order), `shuffle(epoch)`, indexing and `len`."""

    def __init__(self, samples: Sequence[Sample], *, seed: int) -> None:
        self.origin_samples = list(samples)
        self.samples = self.origin_samples
        self.seed = seed
        self.epoch_id = -1

    def shuffle(self, new_epoch_id: int) -> None:
        """This epoch's order: slime's permutation (random.shuffle seeded with seed + epoch)."""
        if self.epoch_id == new_epoch_id:
            return
        permutation = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(permutation)
        self.samples = [self.origin_samples[i] for i in permutation]
        self.epoch_id = new_epoch_id

    def __getitem__(self, idx: int) -> Sample:
        return self.samples[idx]

    def __len__(self) -> int:
        return len(self.samples)


def read_prompt_dataset(args: Any) -> PromptDataset:
    """`args.prompt_data` as slime's Samples, read as tether's own data source reads it."""
    from tether.rollout.data.source import load_prompts, load_tokenizer
    from tether.runtime.errors import ConfigError

    if args.hf_checkpoint is None:
        raise ConfigError(
            "--hf-checkpoint", None, "must be set: the prompts are tokenized with its tokenizer"
        )
    records, dropped = load_prompts(
        args.prompt_data,
        load_tokenizer(args.hf_checkpoint),
        input_key=args.input_key,
        label_key=args.label_key,
        metadata_key=args.metadata_key,
        apply_chat_template=args.apply_chat_template,
        max_prompt_len=args.rollout_max_prompt_len,
        tool_key=args.tool_key,
        apply_chat_template_kwargs=args.apply_chat_template_kwargs,
    )
    if dropped:
        log.info("%s: %d prompts longer than --rollout-max-prompt-len left out", args.prompt_data, dropped)
    samples = [Sample(prompt=r.prompt, label=r.label, metadata=r.metadata) for r in records]
    return PromptDataset(samples, seed=args.rollout_seed)


class RolloutDataSource(DataSource):
    """slime's prompt-file data source (see the module docstring); `add_samples` is refused, as
    in slime: it is read-only."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.epoch_id = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self.sample_offset = 0
        self.metadata: dict[str, Any] = {}
        self.dataset: PromptDataset | None = None
        if args.rollout_global_dataset and args.prompt_data is not None:
            self.dataset = read_prompt_dataset(args)
            if args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next `num_samples` prompts, each as a group of --n-samples-per-prompt numbered
        copies; past the end of the data the next epoch begins (reshuffled with --rollout-shuffle).
        Without a dataset: blank Samples."""
        if self.dataset is not None:
            end = self.sample_offset + num_samples
            if end <= len(self.dataset):
                prompts = self.dataset.samples[self.sample_offset : end]
                self.sample_offset = end
            else:
                prompts = self.dataset.samples[self.sample_offset :]
                rest = num_samples - len(prompts)
                self.epoch_id += 1
                if self.args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
                prompts = prompts + self.dataset.samples[:rest]
                self.sample_offset = rest
        else:
            prompts = [Sample() for _ in range(num_samples)]
        groups = []
        for prompt in prompts:
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise RuntimeError(f"Cannot add samples to {type(self).__name__}: it is a read-only data source")

    def state_dict(self) -> dict[str, Any]:
        """The position slime saves."""
        return {
            "sample_offset": self.sample_offset,
            "epoch_id": self.epoch_id,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "metadata": self.metadata,
        }

    def save(self, rollout_id: int) -> None:
        """The position in slime's file under `args.save` (written atomically)."""
        if not self.args.rollout_global_dataset or self.args.save is None:
            return
        import torch

        from tether.rollout.data.slime_state import state_path
        from tether.runtime.files.atomic_file import write_bytes_atomic

        data = io.BytesIO()
        torch.save(self.state_dict(), data)
        write_bytes_atomic(state_path(self.args.save, rollout_id), data.getvalue())

    def load(self, rollout_id: int | None = None) -> None:
        """The position slime's file under `args.load` holds for `rollout_id`; none: unchanged."""
        if not self.args.rollout_global_dataset or self.args.load is None:
            return
        import torch

        from tether.rollout.data.slime_state import state_path

        path = state_path(self.args.load, -1 if rollout_id is None else rollout_id)
        if not Path(path).exists():
            log.info("%s does not exist: the data starts from its beginning", path)
            return
        state = torch.load(path, map_location="cpu", weights_only=True)  # plain ints and dicts
        self.sample_offset = state.get("sample_offset", 0)
        self.epoch_id = state.get("epoch_id", 0)
        self.sample_group_index = state.get("sample_group_index", 0)
        self.sample_index = state.get("sample_index", 0)
        self.metadata = state.get("metadata", {})
        if self.args.rollout_shuffle and self.dataset is not None:
            self.dataset.shuffle(self.epoch_id)

    def __len__(self) -> int:
        return 0 if self.dataset is None else len(self.dataset)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """slime's data source with a buffer: `get_samples` takes groups from the buffer first (chosen
    by --buffer-filter-path, default `pop_first`), `add_samples` puts groups into it."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.buffer: list[list[Any]] = []
        self.buffer_filter: Callable[..., list[list[Any]]] = pop_first
        if args.buffer_filter_path is not None:
            from tether.rollout.slime_api.utils.misc import _load_for_flag

            self.buffer_filter = _load_for_flag(args.buffer_filter_path, "--buffer-filter-path")

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        samples = self._get_samples_from_buffer(num_samples)
        num_samples -= len(samples)
        if num_samples == 0:
            return samples
        return samples + super().get_samples(num_samples)

    def _get_samples_from_buffer(self, num_samples: int) -> list[list[Any]]:
        if not self.buffer or num_samples == 0:
            return []
        return list(self.buffer_filter(self.args, None, self.buffer, num_samples))

    def add_samples(self, samples: list[list[Any]]) -> None:
        if not samples:
            return
        if not isinstance(samples, list) or not all(isinstance(g, list) for g in samples):
            raise TypeError(f"samples must be a list of groups (lists), got {type(samples).__name__}")
        for group in samples:
            if len(group) != self.args.n_samples_per_prompt:
                raise ValueError(
                    f"a group holds {len(group)} samples; --n-samples-per-prompt is {self.args.n_samples_per_prompt}"
                )
            self.buffer.append(group)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata.update(metadata)

    def get_metadata(self) -> dict[str, Any]:
        return self.metadata

    def get_buffer_length(self) -> int:
        return len(self.buffer)


def pop_first(
    args: Any, rollout_id: int | None, buffer: list[list[Any]], num_samples: int
) -> list[list[Any]]:
    """The default buffer filter: the oldest `num_samples` groups, removed from the buffer."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken

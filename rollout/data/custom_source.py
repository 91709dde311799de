"""slime's --data-source-path and --disable-rollout-global-dataset on tether's data source interface.

slime builds its prompt source as `load_function(args.data_source_path)(args)` and calls, on the
instance, `get_samples(num_samples)` (groups of Samples), `add_samples(groups)` (aborted groups
back), `save(rollout_id)` at each checkpoint, `load(start_rollout_id - 1)` once before the first
rollout, and `len()` (prompts per epoch, for --num-epoch). `HookDataSource` wraps such an instance
so tether's rollout functions, its fully-async worker and slime-API rollout functions use it like
tether's own `DataSource`: Samples cross in both directions (slime's are converted), a pending
sample without prompt tokens gets them from its prompt (as slime's generate tokenizes it), and
missing `index`/`group_index` are numbered. The instance keeps its own position: tether calls
`save`/`load` as slime does, and a resume restores what the class saved (slime writes under
`args.save` and reads from `args.load`). A class may subclass slime's `RolloutDataSource` or
`RolloutDataSourceWithBuffer` (`tether.rollout.slime_api.rollout.data_source`), inheriting slime's
prompt reading from --prompt-data, epoch/shuffle position and its save/load.

`--disable-rollout-global-dataset` (slime's `rollout_global_dataset = False`): no prompt file; the
data source hands out blank Samples (numbered, no prompt) and is never saved or loaded, so a
custom rollout function (or --data-source-path class) supplies the prompts. slime's default
rollout refuses this, and so does tether (at plan time, `check_global_dataset_flags`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from tether.rollout.data.source import DataSource, DataSourceState, render_prompt
from tether.rollout.hooks.calls import HookError, load_function
from tether.rollout.sample import Sample, SampleStatus
from tether.rollout.slime_api.convert import ConversionError, from_slime, is_slime_sample, to_slime
from tether.runtime.errors import ConfigError

FLAG = "--data-source-path"

SLIME_DEFAULT_SOURCES = frozenset(
    {
        "slime.rollout.data_source.RolloutDataSourceWithBuffer",
        "slime.rollout.data_source:RolloutDataSourceWithBuffer",
    }
)
"""slime's default class: tether's own data source does what it does (prompts from --prompt-data,
a buffer with --buffer-filter-path, the position saved with checkpoints)."""

METHODS = ("get_samples", "add_samples", "save", "load", "__len__")
"""What slime calls on a data source (its `DataSource` base class's abstract methods)."""

DEFAULT_ROLLOUT = "tether.rollout.hooks.default_rollout.generate_rollout"


def is_custom_source(path: str | None) -> bool:
    """Whether --data-source-path names a class other than slime's default (tether's own source)."""
    return path is not None and path not in SLIME_DEFAULT_SOURCES


def check_data_source_class(path: str | None) -> Any:
    """`tether plan`: the class imports, is a class taking `cls(args)`, and has slime's methods.
    Returns the class (None for tether's own source)."""
    if not is_custom_source(path):
        return None
    assert path is not None
    cls = load_function(path, FLAG)
    if not inspect.isclass(cls):
        raise ConfigError(
            FLAG, path, f"must name a class (slime builds it as cls(args)); got {type(cls).__name__}"
        )
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing or abstract:
        raise ConfigError(
            FLAG,
            path,
            f"must implement slime's DataSource methods {', '.join(METHODS)}; "
            f"{'missing ' + ', '.join(missing) if missing else 'abstract: ' + ', '.join(abstract)}",
        )
    try:
        inspect.signature(cls).bind("args")
    except TypeError as exc:
        raise ConfigError(FLAG, path, f"cannot be built as cls(args): {exc}") from None
    except ValueError:
        pass  # no signature to inspect (an extension type)
    return cls


def check_global_dataset_flags(
    disabled: bool, prompt_data: str | None, rollout_function_path: str, data_source_path: str | None
) -> None:
    """--disable-rollout-global-dataset against the flags that need the global dataset (slime's asserts)."""
    if not disabled:
        return
    if rollout_function_path == DEFAULT_ROLLOUT:
        raise ConfigError(
            "--disable-rollout-global-dataset",
            True,
            "leaves the default rollout without prompts (slime's asserts it too): give a "
            "--rollout-function-path that supplies its own prompts",
        )
    if prompt_data is not None and not is_custom_source(data_source_path):
        raise ConfigError(
            "--prompt-data",
            prompt_data,
            "is not read with --disable-rollout-global-dataset (the data source hands out blank samples); "
            "drop one of them, or read it in a --data-source-path class (args.prompt_data)",
        )


class HookDataSource(DataSource):
    """A --data-source-path instance behind tether's data source interface (module docstring)."""

    def __init__(
        self, instance: Any, *, path: str, n_samples_per_prompt: int, tokenizer: Any, global_dataset: bool
    ) -> None:
        # tether's DataSource.__init__ reads a prompt list; this one holds none, only the counters
        # it needs to number samples the class leaves unnumbered.
        self.instance = instance
        self.path = path
        self.global_dataset = global_dataset
        self.dropped_long_prompts = 0
        self._n = n_samples_per_prompt
        self._tokenizer = tokenizer
        self._state = DataSourceState()
        self._slime = False
        """Whether the instance speaks slime's Samples (learnt from what it returns)."""

    def __len__(self) -> int:
        return len(self.instance)

    @property
    def buffer_size(self) -> int:
        length = getattr(self.instance, "get_buffer_length", None)
        return int(length()) if callable(length) else 0

    def next_prompts(self, num: int) -> Any:
        raise HookError(
            self.path, "a --data-source-path class hands out groups (get_samples), not prompt records"
        )

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        result = self.instance.get_samples(num_groups)
        if not isinstance(result, list) or not all(isinstance(g, list) for g in result):
            raise HookError(
                self.path,
                f"get_samples({num_groups}) returned {type(result).__name__}; expected a list of groups (lists of Samples)",
            )
        groups: list[list[Sample]] = []
        for g, group in enumerate(result):
            converted = []
            for i, item in enumerate(group):
                self._slime = self._slime or is_slime_sample(item)
                try:
                    sample = from_slime(item)
                except ConversionError as exc:
                    raise HookError(
                        self.path, f"get_samples: group {g} sample {i}: {exc}", field=exc.field
                    ) from exc
                converted.append(self._ready(sample, g, i))
            if converted:
                groups.append(converted)
        st = self._state
        for group in groups:
            if any(s.group_index is None for s in group):
                for s in group:
                    s.group_index = st.next_group_index
                st.next_group_index += 1
            for s in group:
                if s.index is None:
                    s.index = st.next_sample_index
                    st.next_sample_index += 1
        return groups

    def _ready(self, sample: Sample, g: int, i: int) -> Sample:
        """A pending sample without tokens gets its prompt's (slime's generate tokenizes it too)."""
        if (
            sample.status is SampleStatus.PENDING
            and not sample.tokens
            and sample.prompt
            and self._tokenizer is not None
        ):
            _, tokens = render_prompt(
                sample.prompt,
                self._tokenizer,
                apply_chat_template=not isinstance(sample.prompt, str),
                where=f"{self.path}: get_samples group {g} sample {i}",
            )
            sample.tokens = tokens
        return sample

    def add_samples(self, groups: Iterable[list[Sample]]) -> None:
        given = [list(g) for g in groups if g]
        if given:
            self.instance.add_samples([[to_slime(s) for s in g] for g in given] if self._slime else given)

    # ----- checkpoints: the instance saves and loads its own state, as in slime -----
    def save_at(self, rollout_id: int) -> None:
        """slime's `data_source.save(rollout_id)` at a checkpoint (not with the global dataset off)."""
        if self.global_dataset:
            self.instance.save(rollout_id)

    def load_at(self, rollout_id: int) -> None:
        """slime's `data_source.load(start_rollout_id - 1)` before the first rollout."""
        if self.global_dataset:
            self.instance.load(rollout_id)

    def state_dict(self, pending: Iterable[list[Sample]] = ()) -> DataSourceState:
        """Only the numbering counters: the position is the instance's own, saved by its `save` (so
        groups the fully-async worker drew ahead are the instance's business, as in slime)."""
        return DataSourceState(
            next_sample_index=self._state.next_sample_index, next_group_index=self._state.next_group_index
        )

    def load_state_dict(self, state: DataSourceState) -> None:
        self._state = DataSourceState(
            next_sample_index=state.next_sample_index, next_group_index=state.next_group_index
        )


class BlankDataSource(DataSource):
    """--disable-rollout-global-dataset without a --data-source-path: numbered blank groups, as
    slime's RolloutDataSource hands out without a dataset, and a buffer for add_samples."""

    def __init__(self, *, n_samples_per_prompt: int) -> None:
        self.dropped_long_prompts = 0
        self._n = n_samples_per_prompt
        self._state = DataSourceState()
        self.buffer_filter = None

    def __len__(self) -> int:
        return 0

    def next_prompts(self, num: int) -> Any:
        from tether.rollout.data.source import PromptRecord

        return [PromptRecord(prompt="", tokens=[]) for _ in range(num)]

    def state_dict(self, pending: Iterable[list[Sample]] = ()) -> DataSourceState:
        return DataSourceState()  # slime saves nothing without the global dataset

    def load_state_dict(self, state: DataSourceState) -> None:
        pass  # nothing was saved: see state_dict


def build_custom_source(
    cls: Any, args: Any, *, path: str, n_samples_per_prompt: int, tokenizer: Any, global_dataset: bool
) -> HookDataSource:
    """`cls(args)` behind tether's interface; a failing constructor is refused naming the flag."""
    try:
        instance = cls(args)
    except Exception as exc:
        raise ConfigError(FLAG, path, f"cls(args) failed: {type(exc).__name__}: {exc}") from exc
    return HookDataSource(
        instance,
        path=path,
        n_samples_per_prompt=n_samples_per_prompt,
        tokenizer=tokenizer,
        global_dataset=global_dataset,
    )

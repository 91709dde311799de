"""The prompt data source: records from JSONL (or parquet), tokenized once, served as groups, resumable.

A position (epoch, offset within the epoch's order, sample and group counters, and the buffer of
partially generated groups) is saved with checkpoints and restored on resume, so no prompt is
skipped or repeated. The order of an epoch is a permutation seeded by (--rollout-seed, epoch), so
the same position always names the same next prompt.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from tether.rollout.config import DataConfig, RolloutConfig
from tether.rollout.sample import Sample, SampleStatus
from tether.runtime.errors import ConfigError, UserError
from tether.runtime.files.atomic_file import write_bytes_atomic

if TYPE_CHECKING:
    import numpy as np

STATE_VERSION = 1


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the data source uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class DataError(UserError, ValueError):
    """A prompt record is malformed; the message names the file, the line and the key."""


class PromptRecord(msgspec.Struct, kw_only=True):
    """One usable prompt: rendered text (or messages), its tokens, label and metadata."""

    prompt: str | list[dict[str, Any]]
    tokens: list[int]
    label: Any = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class DataSourceState(msgspec.Struct, kw_only=True):
    """Where the data source stands; saved with checkpoints."""

    version: int = STATE_VERSION
    epoch: int = 0
    offset: int = 0
    next_sample_index: int = 0
    next_group_index: int = 0
    num_prompts: int = 0
    buffer: list[list[Sample]] = msgspec.field(default_factory=list)


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Raw records from a JSONL file (or parquet, when pyarrow is installed)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--prompt-data", str(path), "no such file")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(
                "--prompt-data", str(path), "parquet needs pyarrow (pip install pyarrow)"
            ) from exc
        return list(pq.read_table(p).to_pylist())
    records: list[dict[str, Any]] = []
    decoder = msgspec.json.Decoder()
    with p.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                doc = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
            if not isinstance(doc, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(doc).__name__}")
            records.append(doc)
    return records


def render_prompt(
    raw: Any,
    tokenizer: Tokenizer,
    *,
    apply_chat_template: bool,
    where: str,
    tools: list[Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str | list[dict[str, Any]], list[int]]:
    """Prompt text (or messages) and its token ids, with the chat template when asked.

    `tools` and `chat_template_kwargs` (--apply-chat-template-kwargs) go to the chat template.
    """
    if apply_chat_template:
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError(
                f"{where}: with --apply-chat-template the prompt must be text or a list of messages"
            )
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        return str(text), list(tokenizer.encode(str(text), add_special_tokens=False))
    if _is_messages(raw):
        # Kept as messages, as slime's dataset keeps them without --apply-chat-template: an SFT rollout
        # (slime.rollout.sft_rollout) renders the whole conversation itself. The tokens are the
        # templated prompt, what a generating rollout would send.
        text = tokenizer.apply_chat_template(
            raw, tools=tools, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        return raw, list(tokenizer.encode(str(text), add_special_tokens=False))
    if not isinstance(raw, str):
        raise DataError(
            f"{where}: prompt must be text or a list of messages (role/content objects), got {raw!r:.80}"
        )
    return raw, list(tokenizer.encode(raw, add_special_tokens=False))


def _is_messages(raw: Any) -> bool:
    return isinstance(raw, list) and bool(raw) and all(isinstance(m, dict) and "role" in m for m in raw)


def load_prompts(
    path: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    input_key: str,
    label_key: str | None,
    metadata_key: str,
    apply_chat_template: bool,
    max_prompt_len: int | None,
    tool_key: str | None = None,
    apply_chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[PromptRecord], int]:
    """Usable prompts from a file and the number dropped for exceeding `max_prompt_len` tokens.

    A record's tools (under `tool_key`: a list, or its JSON text) go to the chat template and into the
    sample's metadata as `tools`.
    """
    records: list[PromptRecord] = []
    dropped = 0
    for lineno, raw in enumerate(read_records(path), start=1):
        where = f"{path}: record {lineno}"
        if input_key not in raw:
            raise DataError(f"{where}: has no key {input_key!r} (--input-key); keys: {sorted(raw)}")
        tools = record_tools(raw, tool_key, where)
        prompt, tokens = render_prompt(
            raw[input_key],
            tokenizer,
            apply_chat_template=apply_chat_template,
            where=where,
            tools=tools,
            chat_template_kwargs=apply_chat_template_kwargs,
        )
        if max_prompt_len is not None and len(tokens) > max_prompt_len:
            dropped += 1
            continue
        if not tokens:
            raise DataError(f"{where}: prompt is empty after tokenization")
        label = raw.get(label_key) if label_key else None
        metadata = raw.get(metadata_key) or {}
        if not isinstance(metadata, dict):
            raise DataError(
                f"{where}: {metadata_key!r} (--metadata-key) must be an object, got {metadata!r:.80}"
            )
        if tools is not None:
            metadata = {**metadata, "tools": tools}
        records.append(PromptRecord(prompt=prompt, tokens=tokens, label=label, metadata=metadata))
    return records, dropped


def record_tools(raw: dict[str, Any], tool_key: str | None, where: str) -> list[Any] | None:
    """A record's tools list under `tool_key` (--tool-key), decoded when given as JSON text."""
    if tool_key is None or tool_key not in raw:
        return None
    tools = raw[tool_key]
    if isinstance(tools, str):
        try:
            tools = msgspec.json.decode(tools)
        except msgspec.DecodeError as exc:
            raise DataError(f"{where}: {tool_key!r} (--tool-key) is text but not JSON: {exc}") from exc
    elif (numpy := sys.modules.get("numpy")) is not None and isinstance(tools, numpy.ndarray):
        # Parquet's readers give arrays; numpy is imported only by what makes them (the head
        # starts its processes before importing it).
        tools = tools.tolist()
    if not isinstance(tools, list):
        raise DataError(f"{where}: {tool_key!r} (--tool-key) must be a list of tools, got {tools!r:.80}")
    return tools


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer in a model directory (never fetched from a hub): the one
    AutoTokenizer gives, its class remembered between runs (`tether.rollout.data.tokenizer_choice`)."""
    from tether.rollout.data.tokenizer_choice import load_tokenizer as load

    return load(path, local_files_only=True)


class DataSource:
    """Serves prompt groups of --n-samples-per-prompt Samples, epoch after epoch, resumably.

    `get_samples(n)` first returns groups from the buffer (unfinished partial-rollout groups and
    requeued groups), then fresh prompts. `add_samples(groups)` puts groups back into the buffer.
    `buffer_filter` (--buffer-filter-path, see `tether.rollout.hooks.calls.buffer_filter`) chooses which
    buffered groups go first; by default the oldest.
    """

    buffer_filter: Callable[[list[list[Sample]], int], list[list[Sample]]] | None = None

    def __init__(
        self,
        prompts: Sequence[PromptRecord],
        *,
        n_samples_per_prompt: int,
        shuffle: bool = False,
        seed: int = 42,
        dropped_long_prompts: int = 0,
    ) -> None:
        if not prompts:
            raise ConfigError("--prompt-data", None, "holds no usable prompts")
        self._prompts = list(prompts)
        self._n = n_samples_per_prompt
        self._shuffle = shuffle
        self._seed = seed
        self.dropped_long_prompts = dropped_long_prompts
        self._state = DataSourceState(num_prompts=len(self._prompts))
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        rollout: RolloutConfig,
        tokenizer: Tokenizer | None = None,
        *,
        path: str | None = None,
    ) -> DataSource:
        source = path or data.prompt_data
        if source is None:
            raise ConfigError("--prompt-data", None, "must be set to a JSONL (or parquet) file")
        if tokenizer is None:
            if rollout.hf_checkpoint is None:
                raise ConfigError("--hf-checkpoint", None, "must be set: the tokenizer comes from it")
            tokenizer = load_tokenizer(rollout.hf_checkpoint)
        prompts, dropped = load_prompts(
            source,
            tokenizer,
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            apply_chat_template=data.apply_chat_template,
            max_prompt_len=rollout.rollout_max_prompt_len,
            tool_key=data.tool_key,
            apply_chat_template_kwargs=data.apply_chat_template_kwargs,
        )
        return cls(
            prompts,
            n_samples_per_prompt=data.n_samples_per_prompt,
            shuffle=data.rollout_shuffle,
            seed=data.rollout_seed,
            dropped_long_prompts=dropped,
        )

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def offset(self) -> int:
        return self._state.offset

    @property
    def buffer_size(self) -> int:
        return len(self._state.buffer)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        import numpy as np

        if not self._shuffle:
            return np.arange(len(self._prompts))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._prompts))

    def next_prompts(self, num: int) -> list[PromptRecord]:
        """The next `num` fresh prompts, crossing epoch boundaries as needed."""
        out: list[PromptRecord] = []
        st = self._state
        while len(out) < num:
            if st.offset >= len(self._order):
                st.epoch += 1
                st.offset = 0
                self._order = self._epoch_order(st.epoch)
            take = min(num - len(out), len(self._order) - st.offset)
            out.extend(self._prompts[int(i)] for i in self._order[st.offset : st.offset + take])
            st.offset += take
        return out

    def make_group(self, record: PromptRecord, n: int | None = None) -> list[Sample]:
        """A fresh group of `n` (default --n-samples-per-prompt) pending Samples for one prompt."""
        st = self._state
        group_index = st.next_group_index
        st.next_group_index += 1
        group: list[Sample] = []
        for _ in range(n or self._n):
            group.append(
                Sample(
                    index=st.next_sample_index,
                    group_index=group_index,
                    prompt=copy.deepcopy(record.prompt),
                    tokens=list(record.tokens),
                    label=copy.deepcopy(record.label),
                    metadata=copy.deepcopy(record.metadata),
                    status=SampleStatus.PENDING,
                )
            )
            st.next_sample_index += 1
        return group

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: buffered ones first (oldest first), then fresh prompts."""
        st = self._state
        if self.buffer_filter is not None and st.buffer:
            groups = list(self.buffer_filter(st.buffer, num_groups))
        else:
            groups = st.buffer[:num_groups]
            del st.buffer[:num_groups]
        for record in self.next_prompts(num_groups - len(groups)):
            groups.append(self.make_group(record))
        return groups

    def add_samples(self, groups: Iterable[list[Sample]]) -> None:
        """Return groups to the buffer (partial rollouts to continue, or requeued prompts)."""
        for group in groups:
            if group:
                self._state.buffer.append(group)

    # ----- resume -----
    def state_dict(self, pending: Iterable[list[Sample]] = ()) -> DataSourceState:
        """The position to save; `pending` (groups drawn but not yet consumed) goes back first."""
        state = msgspec.structs.replace(self._state, buffer=[*pending, *self._state.buffer])
        return msgspec.convert(msgspec.to_builtins(state), DataSourceState)  # a deep copy

    def load_state_dict(self, state: DataSourceState) -> None:
        if state.version != STATE_VERSION:
            raise DataError(f"data source state version {state.version} is not {STATE_VERSION}")
        if state.num_prompts != len(self._prompts):
            raise DataError(
                f"data source state was saved over {state.num_prompts} prompts; the data now holds "
                f"{len(self._prompts)} (did --prompt-data or --rollout-max-prompt-len change?)"
            )
        self._state = msgspec.convert(msgspec.to_builtins(state), DataSourceState)
        self._order = self._epoch_order(self._state.epoch)

    def save(self, path: str | os.PathLike[str], pending: Iterable[list[Sample]] = ()) -> None:
        """Write the position atomically (msgpack)."""
        write_bytes_atomic(Path(path), msgspec.msgpack.encode(self.state_dict(pending)))

    def load(self, path: str | os.PathLike[str]) -> None:
        raw = Path(path).read_bytes()
        try:
            state = msgspec.msgpack.decode(raw, type=DataSourceState)
        except msgspec.DecodeError as exc:
            raise DataError(f"{path}: not a data source state: {exc}") from exc
        self.load_state_dict(state)

"""Evaluation datasets, each with its own settings: slime's --eval-config, or --eval-prompt-data pairs.

An --eval-config file (YAML or JSON, read with OmegaConf as slime does, so `${...}` interpolations
resolve) holds `eval: {defaults: {...}, datasets: [...]}` (or that mapping at its root); datasets
are a list of entries with a `name`, or a mapping by name. Each setting of a dataset resolves as in
slime: the dataset's own value, else `defaults`, else the eval flag (`--eval-temperature`, ...),
else the rollout's flag (`--rollout-temperature`, ...). An entry's `rm_type` and
`metadata_overrides` go into each of its samples' metadata (a sample's `rm_type` picks its
reward). Keys slime has for features tether does not run are refused naming the dataset and the
key, and so is any key slime does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from tether.runtime.errors import ConfigError

FLAG = "--eval-config"

# setting -> the flags that give it when neither the dataset nor `defaults` does, first set wins
FROM_FLAGS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt",),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "max_prompt_len": ("eval_max_prompt_len", "rollout_max_prompt_len"),
    "max_context_len": ("eval_max_context_len", "rollout_max_context_len"),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
    "skip_special_tokens": ("rollout_skip_special_tokens",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("custom_rm_path",),
    "reward_key": ("eval_reward_key", "reward_key"),
}
OWN_ONLY = (
    "rm_type",
    "repetition_penalty",
    "no_stop_trim",
    "custom_generate_function_path",
    "metadata_overrides",
)
"""Settings only an entry or `defaults` gives (no flag stands behind them)."""
REFUSED: dict[str, str] = {
    "multimodal_keys": "tether trains and evaluates text only",
    "app_service": "tether has no AppServer generation proxy",
    "eval_task_timeout": "tether's evaluation has no per-task timeout",
    "eval_early_stop_remaining": "tether's evaluation has no early stop",
    "eval_early_stop_idle_timeout": "tether's evaluation has no early stop",
    "min_eval_samples": "tether's evaluation has no early stop",
    "message_processor": "tether has no per-source message processors",
    "reward_model": "tether has no per-source reward model config (use rm_type or custom_rm_path)",
    "remote_environment": "tether has no remote environments",
}
KNOWN = frozenset({"name", "path", *FROM_FLAGS, *OWN_ONLY})


class EvalDataset(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation dataset with every setting resolved."""

    name: str
    path: str
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int | None = None
    max_prompt_len: int | None = None
    max_context_len: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    min_new_tokens: int | None = None
    skip_special_tokens: bool = False
    repetition_penalty: float | None = None
    no_stop_trim: bool | None = None
    input_key: str = "input"
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str = "metadata"
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    reward_key: str | None = None
    metadata_overrides: dict[str, Any] = msgspec.field(default_factory=dict)

    def sample_metadata(self) -> dict[str, Any]:
        """What goes into each sample's metadata: `rm_type` (picks its reward) and the overrides."""
        extra: dict[str, Any] = {} if self.rm_type is None else {"rm_type": self.rm_type}
        return {**extra, **self.metadata_overrides}


def _read(path: str) -> Any:
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException
    except ImportError as exc:  # a dependency of tether's; a broken install says so
        raise ConfigError(FLAG, path, f"needs omegaconf to read it ({exc})") from None
    if not Path(path).is_file():
        raise ConfigError(FLAG, path, "is not a file")
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ConfigError(FLAG, path, f"cannot be read as YAML/JSON: {exc}") from None


def read_eval_config(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`defaults` and the dataset entries of an --eval-config file, every key checked."""
    root = _read(path)
    if not isinstance(root, dict):
        raise ConfigError(FLAG, path, "must hold a mapping at its root")
    section = root.get("eval", root)
    if not isinstance(section, dict):
        raise ConfigError(FLAG, path, "`eval` must be a mapping with `datasets` (and optional `defaults`)")
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(FLAG, path, f"`eval.defaults` must be a mapping, not {type(defaults).__name__}")
    raw = section.get("datasets")
    entries: list[dict[str, Any]] = []
    if isinstance(raw, dict):
        for name, entry in raw.items():
            entries.append({"name": str(name), **_entry(path, str(name), entry)})
    elif isinstance(raw, list):
        for pos, entry in enumerate(raw):
            item = _entry(path, f"#{pos}", entry)
            if "name" not in item:
                raise ConfigError(FLAG, path, f"dataset #{pos} has no `name`")
            entries.append(item)
    if not entries:
        raise ConfigError(FLAG, path, "defines no datasets under `eval.datasets`")
    _check_keys(path, "eval.defaults", defaults, allow_identity=False)
    names = [str(e["name"]) for e in entries]
    for entry in entries:
        _check_keys(path, f"dataset {entry['name']!r}", entry, allow_identity=True)
        if "path" not in entry:
            raise ConfigError(FLAG, path, f"dataset {entry['name']!r} has no `path`")
    duplicate = sorted({n for n in names if names.count(n) > 1})
    if duplicate:
        raise ConfigError(FLAG, path, f"dataset names repeat: {duplicate}")
    return dict(defaults), entries


def _entry(path: str, where: str, entry: Any) -> dict[str, Any]:
    if entry is None:
        return {}
    if not isinstance(entry, dict):
        raise ConfigError(FLAG, path, f"dataset {where} must be a mapping, not {type(entry).__name__}")
    return dict(entry)


def _check_keys(path: str, where: str, mapping: dict[str, Any], *, allow_identity: bool) -> None:
    for key in mapping:
        if key in REFUSED:
            raise ConfigError(FLAG, path, f"{where}: `{key}` is not supported: {REFUSED[key]}")
        if key not in KNOWN or (not allow_identity and key in ("name", "path")):
            raise ConfigError(FLAG, path, f"{where}: unknown key `{key}`; known keys: {sorted(KNOWN)}")


def _flag_value(slices: tuple[Any, ...], names: tuple[str, ...]) -> Any:
    for name in names:
        for part in slices:
            value = getattr(part, name, None)
            if value is not None:
                return value
    return None


def resolve_eval_datasets(data: Any, rollout: Any) -> list[EvalDataset]:
    """Every evaluation dataset with its settings (see the module docstring); [] without eval data."""
    if data.eval_config is not None:
        defaults, entries = read_eval_config(data.eval_config)
    else:
        defaults, entries = {}, [{"name": n, "path": p} for n, p in data.eval_datasets()]
    out: list[EvalDataset] = []
    for entry in entries:
        settings: dict[str, Any] = {"name": str(entry["name"]), "path": str(entry["path"])}
        for key in (*FROM_FLAGS, *OWN_ONLY):
            if key in entry:
                settings[key] = entry[key]
            elif key in defaults:
                settings[key] = defaults[key]
            elif key in FROM_FLAGS:
                value = _flag_value((data, rollout), FROM_FLAGS[key])
                if value is not None:
                    settings[key] = value
        try:
            out.append(msgspec.convert(settings, EvalDataset, strict=False))
        except msgspec.ValidationError as exc:
            source = data.eval_config or "--eval-prompt-data"
            raise ConfigError(FLAG, source, f"dataset {settings['name']!r}: {exc}") from None
    return out

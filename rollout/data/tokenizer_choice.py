"""The tokenizer class AutoTokenizer picks for a model directory, remembered between runs.

`AutoTokenizer.from_pretrained(path)` first decides which class to build: from the model's config
(read through AutoConfig, whose import brings in transformers' modelling utilities and torch) and
the tokenizer's own files, then calls that class's `from_pretrained`. The decision is ~1.3 s of
CPU in the head (measured on the demo model, torch already imported) and a pure function of the
directory's files and the transformers version. tether keeps it in a small file keyed by exactly
those (`inputs_key`), and on a hit builds the class directly, as AutoTokenizer itself ends. A miss,
a class from a model's own code (`auto_map`), a path AutoTokenizer treats by its name
(`MODEL_IDS_TO_TOKENIZERS_BACKEND`) or no usable cache directory asks AutoTokenizer, and a miss
records its answer. A directory whose configs name code of their own (`auto_map`) always asks
AutoTokenizer: there `trust_remote_code` decides.

The cache is `tokenizer_classes.json` in `$TETHER_CACHE_DIR` (`tether.runtime.files.cache_dir`:
default `$XDG_CACHE_HOME/tether`, else `~/.cache/tether`); `TETHER_CACHE_DIR=` (empty) turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import xxhash

from tether.runtime.files.atomic_file import write_bytes_atomic
from tether.runtime.files.cache_dir import cache_dir

CACHE_FILE = "tokenizer_classes.json"
FORMAT = 1
MAX_ENTRIES = 256
# Weights never decide the tokenizer class: not read (a checkpoint may be hundreds of GB).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".npz")
# Larger files are keyed by size and modification time instead of content.
MAX_HASHED_BYTES = 256 * 2**20


def inputs_key(path: Path) -> str | None:
    """A digest of everything in `path` AutoTokenizer's choice could read (every file but the
    weights: names, sizes and contents); None when `path` is not a directory."""
    if not path.is_dir():
        return None
    digest = xxhash.xxh3_128()
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.endswith(WEIGHT_SUFFIXES) or not entry.is_file():
            digest.update(f"{entry.name}\0".encode())  # its presence, not its bytes
            continue
        stat = entry.stat()
        digest.update(f"{entry.name}\0{stat.st_size}\0".encode())
        if stat.st_size > MAX_HASHED_BYTES:
            digest.update(f"{stat.st_mtime_ns}\0".encode())
            continue
        with open(entry.path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}  # absent, unreadable or half-written by another tool: as if empty
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def _matches_by_name(path: str, patterns: list[str]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(path.lower(), p) for p in patterns)


def remembered(path: str, version: str, *, key: str | None = None) -> type | None:
    """The class a miss recorded for `path`'s files under transformers `version`, or None.
    `key`: `inputs_key(path)`, where the caller has it already."""
    where = cache_dir()
    key = key or inputs_key(Path(path))
    if where is None or key is None:
        return None
    by_version = _read(where / CACHE_FILE).get("transformers", {}).get(version)
    if not isinstance(by_version, dict):
        return None
    patterns = by_version.get("by_name", [])
    if not isinstance(patterns, list) or _matches_by_name(path, [str(p) for p in patterns]):
        return None
    entry = by_version.get("classes", {}).get(key)
    if not isinstance(entry, dict):
        return None
    module, name = entry.get("module"), entry.get("name")
    if not isinstance(module, str) or not module.startswith("transformers.") or not isinstance(name, str):
        return None
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # moved or gone: ask AutoTokenizer again
    return found if isinstance(found, type) else None


def remember(path: str, version: str, cls: type, by_name: list[str], *, key: str | None = None) -> None:
    """Record AutoTokenizer's answer for `path`'s files (`key`: their `inputs_key`, taken before
    AutoTokenizer read them); a class from a model's own code (or anything outside transformers)
    is never recorded. Best effort: a cache that cannot be written is skipped."""
    where = cache_dir()
    key = key or inputs_key(Path(path))
    if where is None or key is None or not cls.__module__.startswith("transformers."):
        return
    if _matches_by_name(path, by_name):
        return
    with contextlib.suppress(OSError):
        where.mkdir(parents=True, exist_ok=True)
        data = _read(where / CACHE_FILE) or {"format": FORMAT}
        versions = data.setdefault("transformers", {})
        entry = versions.get(version)
        if not isinstance(entry, dict):
            entry = versions[version] = {}
        entry["by_name"] = list(by_name)
        classes = entry.get("classes")
        if not isinstance(classes, dict):
            classes = entry["classes"] = {}
        classes.pop(key, None)
        classes[key] = {"module": cls.__module__, "name": cls.__qualname__}
        while len(classes) > MAX_ENTRIES:  # the oldest first (dicts keep insertion order)
            classes.pop(next(iter(classes)))
        write_bytes_atomic(where / CACHE_FILE, json.dumps(data, indent=1).encode())


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """What `AutoTokenizer.from_pretrained(path, **kwargs)` returns, its class taken from the
    cache when these files' choice is known (see the module docstring). Only `trust_remote_code`
    and `local_files_only` may be given with the cache; other arguments ask AutoTokenizer."""
    from tether.runtime.process.deferred_package import defer_transformers_models

    defer_transformers_models()  # the tokenizer's model modules alone, not transformers' 400
    import transformers

    memo = set(kwargs) <= {"trust_remote_code", "local_files_only"} and not _has_own_code(path)
    version = str(transformers.__version__)
    # Hashed once, before AutoTokenizer reads the files: what a miss records is keyed by them.
    key = inputs_key(Path(path)) if memo and cache_dir() is not None else None
    cls = remembered(path, version, key=key) if key is not None else None
    if cls is not None:
        # As AutoTokenizer ends, with its arguments but `trust_remote_code` (a remembered class
        # is never a model's own code).
        rest = {k: v for k, v in kwargs.items() if k != "trust_remote_code"}
        return cls.from_pretrained(path, **rest)  # type: ignore[attr-defined]
    from transformers import AutoTokenizer
    from transformers.models.auto import tokenization_auto

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if key is not None:
        by_name = [str(p) for p in getattr(tokenization_auto, "MODEL_IDS_TO_TOKENIZERS_BACKEND", ())]
        remember(path, version, type(tokenizer), by_name, key=key)
    return tokenizer


def _has_own_code(path: str) -> bool:
    """Whether the model directory names code of its own (`auto_map`): whether AutoTokenizer
    picks that code depends on `trust_remote_code`, so such a choice is not remembered."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            data = json.loads((Path(path) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "auto_map" in data:
            return True
    return False

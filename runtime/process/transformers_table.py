"""transformers' table of its models' exported names, remembered between runs.

`import transformers` builds its lazy module's name table with
`define_import_structure(<package>/models, prefix="models")`, which reads the source of every
file of its ~400 model directories and scans each for `__all__` and backend decorators: ~0.3 s of
CPU in every process that imports transformers (the head for its tokenizer, the rank zygote for
the model's config), before anything is used. The table is a function of those files alone, so
tether keeps it in `$TETHER_CACHE_DIR/transformers_tables.json` (`tether.runtime.files.cache_dir`)
and hands it back to transformers' `__init__` the next time, as `define_import_structure`
itself would have returned it.

The key (`install_key`) is the transformers version and directory, its pip install record
(RECORD: size and modification time: any install, upgrade or reinstall rewrites it) and the
modification time of every model directory (a file added, removed or renamed in one changes it).
An install without a RECORD or marked editable (`direct_url.json`) is never cached: its files
change in place. `TETHER_CACHE_DIR=` (empty) turns the cache off; a corrupt or unwritable cache
is a miss.

`remember_transformers_table()` must run before transformers is imported: it wraps the function
as `transformers.utils.import_utils` finishes executing (a one-shot import hook), before
`transformers/__init__` takes it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from tether.runtime.files.atomic_file import write_bytes_atomic
from tether.runtime.files.cache_dir import cache_dir

CACHE_FILE = "transformers_tables.json"
FORMAT = 1
MAX_TABLES = 8  # installs (virtual environments, versions) remembered at once
HOOKED = "tether.runtime.process.transformers_table"  # marks the wrapped function
TARGET = "transformers.utils.import_utils"

Table = dict[frozenset[str], dict[str, set[str]]]
"""{backends needed: {module: names it exports}}, as `define_import_structure` returns it."""


def install_key(package_dir: Path) -> str | None:
    """The key of the transformers installed in `package_dir` (see the module docstring), or
    None where it must not be cached (no pip record, an editable install, no models dir)."""
    models = package_dir / "models"
    dist_infos = sorted(package_dir.parent.glob("transformers-*.dist-info"))
    if len(dist_infos) != 1 or not models.is_dir():
        return None
    info = dist_infos[0]
    direct_url = info / "direct_url.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(direct_url.read_text()).get("dir_info", {}).get("editable"):
            return None
    try:
        record = (info / "RECORD").stat()
        entries = sorted(os.scandir(models), key=lambda e: e.name)
        digest = xxhash.xxh3_128(f"{FORMAT}\0{package_dir}\0{info.name}\0".encode())
        digest.update(f"{record.st_size}\0{record.st_mtime_ns}\0".encode())
        for entry in entries:
            digest.update(f"{entry.name}\0{entry.stat().st_mtime_ns}\0".encode())
    except OSError:
        return None
    return digest.hexdigest()


def encode_table(table: Table) -> list[list[Any]]:
    """The table as JSON lists: [[sorted backends, {module: sorted names}], ...]."""
    rows = [
        [sorted(backends), {m: sorted(n) for m, n in sorted(modules.items())}]
        for backends, modules in table.items()
    ]
    return sorted(rows, key=lambda row: row[0])


def decode_table(rows: object) -> Table | None:
    """`encode_table`'s lists back as the table; None where they are not such lists."""
    if not isinstance(rows, list):
        return None
    table: Table = {}
    for row in rows:
        if not (
            isinstance(row, list) and len(row) == 2 and isinstance(row[0], list) and isinstance(row[1], dict)
        ):
            return None
        backends, modules = row
        if not all(isinstance(b, str) for b in backends):
            return None
        entry: dict[str, set[str]] = {}
        for module, names in modules.items():
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                return None
            entry[module] = set(names)
        table[frozenset(backends)] = entry
    return table


def _read(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def remembered(key: str) -> Table | None:
    """The table a miss recorded under `key`, or None."""
    where = cache_dir()
    if where is None:
        return None
    return decode_table(_read(where / CACHE_FILE).get("tables", {}).get(key))


def remember(key: str, table: Table) -> None:
    """Record `table` under `key` (best effort: a cache that cannot be written is skipped)."""
    where = cache_dir()
    if where is None:
        return
    try:
        rows = encode_table(table)
    except (TypeError, ValueError, AttributeError):  # a shape this module does not know: not kept
        return
    with contextlib.suppress(OSError):
        where.mkdir(parents=True, exist_ok=True)
        data = _read(where / CACHE_FILE) or {"format": FORMAT}
        tables = data.get("tables")
        if not isinstance(tables, dict):
            tables = data["tables"] = {}
        tables.pop(key, None)
        tables[key] = rows
        while len(tables) > MAX_TABLES:  # the oldest first (dicts keep insertion order)
            tables.pop(next(iter(tables)))
        write_bytes_atomic(where / CACHE_FILE, json.dumps(data, separators=(",", ":")).encode())


def remembering(original: Callable[..., Table], package_dir: Path) -> Callable[..., Table]:
    """`define_import_structure`, its answer for `package_dir/models` taken from the cache (and
    recorded there on a miss); every other call goes to `original` as before."""
    models = package_dir / "models"

    @functools.wraps(original)
    def define_import_structure(module_path: str | os.PathLike[str], prefix: str | None = None) -> Table:
        key = None
        if prefix == "models" and Path(module_path) == models:
            with contextlib.suppress(Exception):  # inside transformers' import: never break it
                key = install_key(package_dir)
        if key is None:
            return original(module_path, prefix)
        table = remembered(key)
        if table is None:
            table = original(module_path, prefix)
            remember(key, table)
        return table

    define_import_structure.__dict__[HOOKED] = True
    return define_import_structure


class _PatchingLoader(importlib.abc.Loader):
    """The real loader of `transformers.utils.import_utils`, with the wrap applied right after
    the module runs (anything else asked of it goes to the real loader)."""

    def __init__(self, inner: importlib.abc.Loader, package_dir: Path) -> None:
        self._inner = inner
        self._package_dir = package_dir

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        original = getattr(module, "define_import_structure", None)
        if callable(original):
            module.define_import_structure = remembering(original, self._package_dir)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils.import_utils` once, through the other finders, and wraps its
    loader; then leaves `sys.meta_path`."""

    def __init__(self, package_dir: Path) -> None:
        self._package_dir = package_dir

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self._package_dir)
                return spec
        return None


def remember_transformers_table() -> bool:
    """Install the hook (see the module docstring); False where transformers is imported
    already, not installed, or the cache is off."""
    if "transformers" in sys.modules or cache_dir() is None:
        return False
    if any(isinstance(finder, _Hook) for finder in sys.meta_path):
        return True
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return False
    sys.meta_path.insert(0, _Hook(Path(spec.origin).parent))
    return True

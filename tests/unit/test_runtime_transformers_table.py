"""transformers' models name table, remembered between runs (tether.runtime.process.transformers_table)."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest
import transformers
import transformers.utils.import_utils as import_utils

from tether.runtime.files.cache_dir import CACHE_ENV
from tether.runtime.process import transformers_table as tt

PACKAGE = Path(transformers.__file__).parent


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / tt.CACHE_FILE


def _fresh() -> tt.Table:
    """What transformers' `__init__` gets from `define_import_structure`, computed anew."""
    import_utils.create_import_structure_from_path.cache_clear()
    build = inspect.unwrap(import_utils.define_import_structure)
    return build(PACKAGE / "models", prefix="models")  # type: ignore[no-any-return]


def test_a_hit_gives_the_table_transformers_builds(cache: Path) -> None:
    """The installed transformers' real table: recorded on a miss, given back equal on a hit
    without scanning the models again; other paths go to transformers as before."""
    calls: list[tuple[object, object]] = []

    def build(module_path: object, prefix: object = None) -> tt.Table:
        calls.append((module_path, prefix))
        return _fresh() if prefix == "models" else {frozenset(): {}}

    define = tt.remembering(build, PACKAGE)
    assert tt.install_key(PACKAGE) is not None  # a pip install, not editable
    first = define(PACKAGE / "models", prefix="models")
    assert cache.is_file() and len(calls) == 1
    expected = _fresh()
    assert first == expected
    second = define(str(PACKAGE / "models"), "models")
    assert second == expected and len(calls) == 1  # from the file
    assert second is not define(PACKAGE / "models", prefix="models")  # a fresh copy: __init__ mutates it
    assert sum(len(v) for v in second.values()) > 1000  # every model's modules, not a stub
    define(PACKAGE / "models" / "__init__.py")  # models/__init__'s own call: not cached
    assert calls[-1] == (PACKAGE / "models" / "__init__.py", None)


def _install(root: Path, *, editable: bool = False) -> Path:
    package = root / "transformers"
    for model in ("llama", "qwen3"):
        (package / "models" / model).mkdir(parents=True)
        (package / "models" / model / "__init__.py").write_text("")
    info = root / "transformers-9.9.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("transformers/__init__.py,,\n")
    if editable:
        (info / "direct_url.json").write_text(
            json.dumps({"url": "file:///src", "dir_info": {"editable": True}})
        )
    return package


def test_the_key_changes_with_the_install_and_its_model_directories(tmp_path: Path) -> None:
    package = _install(tmp_path)
    key = tt.install_key(package)
    assert key is not None and tt.install_key(package) == key
    llama = package / "models" / "llama"
    os.utime(llama, ns=(1, 1))  # a file added, removed or renamed in it
    moved = tt.install_key(package)
    assert moved not in (None, key)
    record = tmp_path / "transformers-9.9.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "transformers/models/llama/new.py,,\n")  # reinstalled
    assert tt.install_key(package) not in (None, key, moved)


def test_editable_or_unrecorded_installs_are_never_cached(tmp_path: Path) -> None:
    assert tt.install_key(_install(tmp_path / "editable", editable=True)) is None
    package = _install(tmp_path / "bare")
    (tmp_path / "bare" / "transformers-9.9.0.dist-info" / "RECORD").unlink()
    assert tt.install_key(package) is None
    two = _install(tmp_path / "two")
    (tmp_path / "two" / "transformers-9.8.0.dist-info").mkdir()
    assert tt.install_key(two) is None


def test_a_broken_cache_is_a_miss_and_is_written_again(cache: Path, tmp_path: Path) -> None:
    package = _install(tmp_path)
    table = {frozenset(): {"models.llama.configuration_llama": {"LlamaConfig"}}, frozenset({"torch"}): {}}
    define = tt.remembering(lambda path, prefix=None: table, package)
    cache.parent.mkdir(parents=True)
    for broken in (
        "{not json",
        json.dumps({"format": tt.FORMAT, "tables": {tt.install_key(package): [[1, 2]]}}),
    ):
        cache.write_text(broken)
        assert define(package / "models", "models") is table  # built, not read
        assert tt.remembered(tt.install_key(package) or "") == table  # and recorded again


def test_an_unwritable_or_switched_off_cache_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = _install(tmp_path)
    table = {frozenset(): {"models.llama.configuration_llama": {"LlamaConfig"}}}
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "sub"))
    assert tt.remembering(lambda path, prefix=None: table, package)(package / "models", "models") is table
    monkeypatch.setenv(CACHE_ENV, "")
    assert tt.remembered("any") is None and tt.remember_transformers_table() is False


def test_the_cache_keeps_the_newest_installs(cache: Path) -> None:
    for i in range(tt.MAX_TABLES + 2):
        tt.remember(f"key{i}", {frozenset(): {f"m{i}": {"X"}}})
    tables = json.loads(cache.read_text())["tables"]
    assert list(tables) == [f"key{i}" for i in range(2, tt.MAX_TABLES + 2)]


def test_a_table_of_another_shape_is_passed_through_unkept(cache: Path, tmp_path: Path) -> None:
    """A transformers whose table is not {backends: {module: names}} gets its own answer back,
    and nothing is recorded (a later version of it may change the shape)."""
    package = _install(tmp_path)
    odd: Any = {frozenset(): {"models.llama": 3}}
    assert tt.remembering(lambda path, prefix=None: odd, package)(package / "models", "models") is odd
    assert not cache.exists()

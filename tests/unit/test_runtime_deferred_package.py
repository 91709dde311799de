"""Packages deferred in sys.modules (tether.runtime.process.deferred_package): a submodule imports
without its package's __init__; any attribute the package lacks runs that __init__ once."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.runtime.process import deferred_package as dp

# Each package's __init__ counts its runs in the `runs` module-level list of `deferred_probe`.
_INIT = """
import deferred_probe
deferred_probe.runs.append(__name__)
WHOLE = "whole"
"""
# An __init__ that replaces its own sys.modules entry, as transformers' _LazyModule does.
_REPLACING_INIT = """
import sys, types
import deferred_probe
deferred_probe.runs.append(__name__)
_real = types.ModuleType(__name__)
_real.__path__ = __path__
_real.WHOLE = "replacement"
sys.modules[__name__] = _real
"""


@pytest.fixture
def packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """`pkg` (with `pkg.sub` and `pkg.inner.leaf`) and `lazypkg` on sys.path; the probe module
    whose `runs` lists each package __init__ run. Everything imported is removed afterwards."""
    (tmp_path / "pkg" / "inner").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text(_INIT)
    (tmp_path / "pkg" / "sub.py").write_text("VALUE = 1\n")
    (tmp_path / "pkg" / "inner" / "__init__.py").write_text(_INIT)
    (tmp_path / "pkg" / "inner" / "leaf.py").write_text("class Leaf:\n    pass\n")
    (tmp_path / "lazypkg").mkdir()
    (tmp_path / "lazypkg" / "__init__.py").write_text(_REPLACING_INIT)
    (tmp_path / "lazypkg" / "part.py").write_text("PART = 2\n")
    (tmp_path / "plain.py").write_text("X = 1\n")
    probe = types.ModuleType("deferred_probe")
    probe.runs = []  # type: ignore[attr-defined]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "deferred_probe", probe)
    monkeypatch.delenv(dp.SWITCH_ENV, raising=False)
    importlib.invalidate_caches()
    yield probe
    for name in [n for n in sys.modules if n.split(".")[0] in ("pkg", "lazypkg", "plain")]:
        del sys.modules[name]


def test_a_submodule_imports_without_its_package_init(packages: types.ModuleType) -> None:
    assert dp.defer(("pkg",))
    assert dp.is_deferred("pkg")
    sub = importlib.import_module("pkg.sub")
    assert sub.VALUE == 1 and packages.runs == []
    import pkg

    assert pkg.sub is sub  # the import system set the child on its deferred parent
    assert packages.runs == [] and dp.is_deferred("pkg")


def test_a_missing_attribute_runs_the_init_once(packages: types.ModuleType) -> None:
    dp.defer(("pkg",))
    import pkg

    assert pkg.WHOLE == "whole"
    assert packages.runs == ["pkg"] and not dp.is_deferred("pkg")
    assert pkg.WHOLE == "whole" and packages.runs == ["pkg"]
    with pytest.raises(AttributeError):
        pkg.nothing_of_that_name  # noqa: B018


def test_nested_packages_complete_child_first(packages: types.ModuleType) -> None:
    assert dp.defer(("pkg", "pkg.inner"))
    leaf = importlib.import_module("pkg.inner.leaf")
    assert leaf.Leaf.__name__ == "Leaf" and packages.runs == []
    dp.complete(("pkg", "pkg.inner"))
    assert packages.runs == ["pkg.inner", "pkg"]
    dp.complete(("pkg", "pkg.inner"))  # once only
    assert packages.runs == ["pkg.inner", "pkg"]


def test_find_answers_without_the_init(packages: types.ModuleType) -> None:
    asked: list[str] = []

    def find(module: types.ModuleType, attr: str) -> object:
        asked.append(attr)
        if attr == "Leaf":
            return importlib.import_module("pkg.inner.leaf").Leaf
        return dp.MISSING

    dp.defer(("pkg",), find)
    import pkg

    assert pkg.Leaf.__name__ == "Leaf"
    assert packages.runs == ["pkg.inner"]  # the leaf's own package only, never pkg's
    assert pkg.WHOLE == "whole" and packages.runs == ["pkg.inner", "pkg"]
    assert asked == ["Leaf", "WHOLE"]


def test_an_init_that_replaces_its_module_is_answered_through_the_deferred_one(
    packages: types.ModuleType,
) -> None:
    dp.defer(("lazypkg",))
    deferred = sys.modules["lazypkg"]
    assert importlib.import_module("lazypkg.part").PART == 2
    assert deferred.WHOLE == "replacement"  # the replacement's answer, via the deferred module
    assert sys.modules["lazypkg"] is not deferred and packages.runs == ["lazypkg"]


def test_nothing_is_deferred_when_imported_missing_switched_off_or_not_a_package(
    packages: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pkg  # noqa: F401  # imported for real first

    assert not dp.defer(("pkg",)) and packages.runs == ["pkg"]  # already imported: left alone
    assert not dp.defer(("no_such_package_here",))
    with pytest.raises(ImportError, match="plain is not a package"):
        dp.defer(("plain",))
    monkeypatch.setenv(dp.SWITCH_ENV, "0")
    assert not dp.defer(("lazypkg",)) and "lazypkg" not in sys.modules

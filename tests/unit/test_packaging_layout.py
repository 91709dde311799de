"""pyproject's package table: every code folder is mapped onto tether.* and every sub-package is
listed, or the wheel ships without it."""

from __future__ import annotations

import tomllib

from support import REPO as ROOT

PACKAGES = ["tether", "tether.runtime", "tether.placement", "tether.rollout", "tether.train", "tether.sync"]


def _package_dir() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def test_every_source_folder_is_mapped_and_listed() -> None:
    table = _package_dir()
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(table) == sorted(PACKAGES)
    found = []
    for package, folder in table.items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{package} -> {folder}/ has no __init__.py"
        found.append(package)
        for init in sorted((ROOT / folder).glob("*/**/__init__.py")):
            found.append(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    # Every sub-package (tether.bench, tether.rollout.cpu_engine, ...) must be listed, or the
    # wheel ships without it.
    assert sorted(listed) == sorted(found)


MAX_MODULES_PER_FOLDER = 15


def test_no_folder_holds_more_than_fifteen_modules_and_each_says_what_it_owns() -> None:
    """A flat folder grows until nobody can find anything in it: past ~15 modules its prefixes are
    folders waiting to exist. Every package's __init__ says what it owns (its docstring)."""
    crowded, silent = [], []
    for folder in _package_dir().values():
        for init in sorted((ROOT / folder).glob("**/__init__.py")):
            modules = [p for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded.append(f"{init.parent.relative_to(ROOT)}: {len(modules)} modules")
            if not init.read_text().lstrip().startswith('"""'):
                silent.append(str(init.relative_to(ROOT)))
    assert not crowded, crowded
    assert not silent, f"packages whose __init__.py has no docstring: {silent}"

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

"""The five code folders install as tether.* — editable and as a wheel — and resist shadowing
(pyproject's package table, read without a process: tests/unit/test_packaging_layout.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from support import REPO as ROOT


def _package_dir() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _user_dir(tmp_path: Path) -> Path:
    """A user's working directory holding their own train.py and runtime.py."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train", "runtime", "sync", "rollout"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('the user module was imported')\n")
    return tmp_path


def test_import_resolves_to_our_package_beside_user_modules(tmp_path: Path) -> None:
    cwd = _user_dir(tmp_path)
    code = "import tether.train, tether.runtime, tether.sync, tether.rollout; print(tether.train.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).resolve() == (ROOT / "train" / "__init__.py").resolve()


def test_console_script_and_launcher_run_the_same_cli(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "tether"
    a = subprocess.run([str(script), "version", "--json"], capture_output=True, text=True, check=True)
    b = subprocess.run(
        [str(ROOT / "bin" / "tether"), "version", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "TETHER_PYTHON": sys.executable},
    )
    assert a.stdout == b.stdout and '"megatron-core"' in a.stdout


def test_wheel_holds_every_module_and_imports_beside_user_modules(tmp_path: Path) -> None:
    out = tmp_path / "wheel"
    # Build from a copy so that setuptools' build/ and egg-info never land in the work tree.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("tether-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, folder in _package_dir().items():
        for source in (ROOT / folder).rglob("*.py"):  # subpackages too: each must be listed in pyproject
            inside = source.relative_to(ROOT / folder).as_posix()
            assert f"{package.replace('.', '/')}/{inside}" in names
    # Import from the wheel alone (zip import), in a directory holding the user's modules.
    cwd = _user_dir(tmp_path / "user")
    code = f"import sys; sys.path.insert(0, {str(wheel)!r}); import tether.train, tether.runtime; print(tether.train.__file__)"
    result = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    )
    assert str(wheel) in result.stdout

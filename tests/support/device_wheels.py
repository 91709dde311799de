"""Stand-in wheel folders for bin/device-check's tests: real wheel file names and METADATA, no code."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bin" / "device-check"


def load_device_check() -> ModuleType:
    """bin/device-check as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("device_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("device_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def fake_wheel(
    folder: Path, name: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = ()
) -> Path:
    stem = name.replace("-", "_")
    path = folder / f"{stem}-{version}-{tag}.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{stem}-{version}.dist-info/METADATA", "\n".join(meta) + "\n\nbody\n")
    return path


def complete_folder(pins: dict[str, str], out: Path) -> Path:
    """Every pin at its version, pyzmq with the binary tags pip picks for the device."""
    out.mkdir(parents=True, exist_ok=True)
    for name, version in pins.items():
        tag = "cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64" if name == "pyzmq" else "py3-none-any"
        fake_wheel(out, name, version, tag)
    return out

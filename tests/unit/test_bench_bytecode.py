"""Benchmarks say how many of tether's modules they ran without current bytecode."""

from __future__ import annotations

import os
import py_compile
from pathlib import Path

import pytest

from tether.bench.bytecode import note_uncompiled, uncompiled_modules


def test_missing_or_outdated_bytecode_is_listed(tmp_path: Path) -> None:
    for name in ("compiled", "missing", "edited"):
        source = tmp_path / "head" / f"{name}.py"
        source.parent.mkdir(exist_ok=True)
        source.write_text("X = 1\n")
        if name != "missing":
            py_compile.compile(str(source), doraise=True)
    edited = tmp_path / "head" / "edited.py"
    stat = edited.stat()
    os.utime(edited, (stat.st_atime, stat.st_mtime + 5))  # changed after it was compiled
    (tmp_path / "train").mkdir()
    assert uncompiled_modules(tmp_path) == ["head/edited.py", "head/missing.py"]


def test_a_result_carries_the_count_and_warns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("tether.bench.bytecode.uncompiled_modules", lambda: ["head/config.py"])
    assert note_uncompiled({"x": 1}, "e2e") == {"x": 1, "uncompiled_modules": 1}
    assert "head/config.py" in capsys.readouterr().err
    monkeypatch.setattr("tether.bench.bytecode.uncompiled_modules", lambda: [])
    assert note_uncompiled({}, "sync") == {"uncompiled_modules": 0}
    assert capsys.readouterr().err == ""

"""`bin/device-check --dry-run` end to end on CPU, with a stand-in wheel folder (no download):
the folder checks, tether's bench command parses through tether's own parser, and tests/gpu runs
with every GPU case skipped and none failing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.device_wheels import SCRIPT, complete_folder, load_device_check


def test_dry_run_passes_on_cpu(tmp_path: Path) -> None:
    folder = complete_folder(load_device_check().PINS, tmp_path / "wheels")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--wheels", str(folder)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "device-check --dry-run: ok" in done.stdout
    assert "tests/gpu collects" in done.stdout

"""`python -m tether.commands.warm_caches` (bin/setup's last step): the caches a first run would
build, filled beforehand, so that the demo's first run hits them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.commands.demo import make_model
from tether.rollout.data import tokenizer_choice
from tether.runtime.process import transformers_table


def _warm(cache: str, **env_over: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TETHER_CACHE_DIR": cache, **env_over}
    return subprocess.run(
        [sys.executable, "-m", "tether.commands.warm_caches"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_warm_caches_fill_what_the_demos_first_run_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    done = _warm(str(cache))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(
        f"warmed in {cache}: transformers' name table, the demo model's tokenizer class"
    ), done.stdout
    monkeypatch.setenv("TETHER_CACHE_DIR", str(cache))
    import transformers

    # the demo's model made elsewhere, with another seed (as `tether demo --seed 7` makes it)
    model = make_model(tmp_path / "demo", seed=7)
    assert tokenizer_choice.remembered(str(model), str(transformers.__version__)) is not None
    key = transformers_table.install_key(Path(transformers.__file__).parent)
    assert key is not None and transformers_table.remembered(key) is not None


def test_warm_caches_with_the_caches_off_writes_nothing(tmp_path: Path) -> None:
    done = _warm("", XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert "caches off" in done.stdout
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()

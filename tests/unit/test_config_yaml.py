"""The configuration from YAML: a file sets the same keys as the flags (which override it), and
its errors name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.config import resolve
from tether.runtime.errors import ConfigError


def test_yaml_sets_keys_and_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "rollout_batch_size: 8\nn_samples_per_prompt: 4\nalgorithm:\n  eps_clip: 0.1\n"
        "sglang_mem_fraction_static: 0.5\nrollout_stop: ['x']\n"
    )
    cfg = resolve(["--config", str(path), "--n-samples-per-prompt", "2"])
    assert cfg.data.rollout_batch_size == 8 and cfg.data.n_samples_per_prompt == 2
    assert cfg.algorithm.eps_clip == pytest.approx(0.1) and cfg.rollout.rollout_stop == ["x"]
    assert cfg.sglang_args == ["--mem-fraction-static", "0.5"]


def test_yaml_errors_name_the_file_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout_batch_size: 4\nbogus_key: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: bogus_key=3"):
        resolve(["--config", str(path)])
    path.write_text("n_samples_per_prompt: -1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: n_samples_per_prompt=-1"):
        resolve(["--config", str(path)])
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        resolve(["--config", str(path)])

"""slime's examples/train_infer_mismatch_helper/mis.py, unchanged, as --custom-tis-function-path with
its mis.yaml as --custom-config-path: read from slime's source (git show; skipped where it is not at
hand), never copied into this tree. Starts `git` only (well under a second)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.loss_cases import loaded_hooks, t, two_samples
from support.slime_source import slime_file

from tether.config import resolve


def test_slimes_mis_py_runs_unchanged_as_the_tis_hook(tmp_path: Path) -> None:
    # slime's examples/train_infer_mismatch_helper/{mis.py,mis.yaml} as slime ships them (read, not copied).
    mis = slime_file("examples/train_infer_mismatch_helper/mis.py", tmp_path / "mis.py")
    yaml_file = slime_file("examples/train_infer_mismatch_helper/mis.yaml", tmp_path / "mis.yaml")
    cfg = resolve(
        [
            "--custom-config-path",
            str(yaml_file),
            "--custom-tis-function-path",
            f"{mis}:compute_mis_weights_with_cp",
        ]
    ).algorithm
    assert cfg.use_tis  # from mis.yaml
    # ratios train/rollout 1, 3, 0.8, 1 (0.8: clear of the [0.5, 2] rejection bounds)
    rollout = t(-1.0, -1.0 - math.log(3.0), -2.0 - math.log(0.8), -0.5)
    out = two_samples(cfg, loaded_hooks(cfg), rollout_log_probs=rollout)
    # mis.yaml: token-level truncate at 2, rejection outside [0.5, 2], batch normalisation to mean 1:
    # truncated 1, 2, 0.8, 1 (mean 1.2), each / 1.2; token 1 rejected (3 > 2). On-policy pg = -A.
    w = [1 / 1.2, 2 / 1.2, 0.8 / 1.2, 1 / 1.2]
    pg = [-1.0, -2.0, 1.0, -4.0]
    kept = [1, 0, 1, 1]
    expected = 0.25 * sum(a * b * c for a, b, c in zip(pg, w, kept, strict=True))
    assert float(out.metrics["pg_loss"]) == pytest.approx(expected)
    assert float(out.metrics["mis_tis_truncate_fraction"]) == pytest.approx(0.25)
    assert float(out.metrics["mis_rs_mask_fraction_high"]) == pytest.approx(0.25)
    # per-sample means of the final weights, (1 + 2) / 2 and (0.8 + 1) / 2, over 1.2, token-averaged
    assert float(out.metrics["mis_is_ratio_mean_final"]) == pytest.approx(0.5 * (1.5 + 0.9) / 1.2)

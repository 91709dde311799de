"""Which runs start their first rollout while the trainer ranks start (`starts_rollout_early`):
only those whose engines already serve the weights the first step trains from, with nothing
else to reach the engines first. A whole run that does: tests/integration/test_e2e_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.config import resolve
from tether.run.job import starts_rollout_early

FRESH = ["--hf-checkpoint", "/models/tiny", "--prompt-data", "/data/p.jsonl", "--num-rollout", "3"]


def test_a_fresh_run_from_the_hf_checkpoint_starts_its_first_rollout_early() -> None:
    assert starts_rollout_early(resolve(FRESH))
    assert starts_rollout_early(resolve([*FRESH, "--loop", "fully-async"]))


@pytest.mark.parametrize(
    "extra",
    [
        # The trainer starts from other weights than the engines load (or may resume).
        ["--load", "{tmp}/ckpt"],
        ["--ref-load", "{tmp}/ref"],
        ["--auto-resume", "--save", "{tmp}/save"],
        # Something must reach the engines before the first rollout.
        ["--check-weight-update-equal"],
        ["--use-fault-tolerance"],
        # No trainer to overlap, or no engines; or the trainers start after the engines anyway.
        ["--debug-rollout-only"],
        ["--debug-train-only"],
        ["--colocate"],
    ],
    ids=lambda extra: extra[0],
)
def test_runs_whose_first_rollout_must_wait_do(tmp_path: Path, extra: list[str]) -> None:
    cfg = resolve([*FRESH, *(e.format(tmp=tmp_path) for e in extra)])
    assert not starts_rollout_early(cfg)

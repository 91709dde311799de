"""Megatron model from HF checkpoints on CPU: conversion round trips and logits parity.

One torchrun launch (2 ranks) checks three layouts (DP=2, TP=2, PP=2) x three families
(Llama; Qwen2 with qkv bias; Qwen3 with qk-norm and tied embeddings): build the actor from HF
weights, export back to HF names (bit-exact), compare logits with transformers, write an HF
directory with save_hf. See tests/support/train_checks/check_model.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

LAYOUTS = ["dp2", "tp2", "pp2"]
FAMILIES = ["llama", "qwen2", "qwen3_tied"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("train_model")
    log = work / "torchrun.log"
    rc = torchrun("check_model.py", str(work), log=log)
    assert rc == 0, log.read_text()[-5000:]
    return [results(work / "results" / f"rank{r}.json") for r in (0, 1)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_hf_round_trip_is_bit_exact(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    for rank_results in checked:
        got = value(rank_results, f"{layout}/{family}/round_trip")
        assert got["mismatched"] == [], got
        assert got["missing"] == [], got
        assert got["count"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checked: list[dict[str, Any]], layout: str, family: str) -> None:
    diffs = [value(r, f"{layout}/{family}/logits") for r in checked]
    on_last_stage = [d for d in diffs if d is not None]
    assert on_last_stage, "no rank held the last pipeline stage"
    assert max(on_last_stage) < 1e-5, diffs


@pytest.mark.parametrize(("layout", "family"), [("pp2", f) for f in FAMILIES] + [("tp2", "qwen3_tied")])
def test_save_hf_writes_the_source_checkpoint_back(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    got = value(checked[0], f"{layout}/{family}/save_hf")
    assert got == {"diff": [], "names_equal": True, "config": True}


def test_check_script_completed(checked: list[dict[str, Any]]) -> None:
    assert all(value(r, "done") is True for r in checked)


def test_results_dir_is_per_rank(checked: list[dict[str, Any]]) -> None:
    assert len(checked) == 2 and all(isinstance(r, dict) for r in checked)
    assert Path(__file__).name.startswith("test_train_")

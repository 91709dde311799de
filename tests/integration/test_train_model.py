"""Megatron model from HF checkpoints on CPU, built and converted through mbridge: conversion round
trips and logits parity for every family tether builds.

One torchrun launch (2 ranks) checks three layouts (DP=2, TP=2, PP=2; and EP=2 for MoE) x twenty-one model variants (Llama;
Qwen2 with qkv bias; Qwen3 with qk-norm, untied and tied; GLM-4 dense with norms after attention and
the MLP, a fused gate_up_proj, qkv bias and interleaved partial RoPE (at TP=2 with sequence
parallelism); Qwen2-MoE with a gated shared expert and
unnormalized top-k; Qwen3-MoE; Mixtral; GLM-4.5 MoE with partial RoPE, attention bias, a dense
first layer and sigmoid routing with a correction bias; MiniMax-M2 with QK norms over all heads,
partial RoPE and biased sigmoid routing; Qwen3-Next with gated-DeltaNet linear attention, gated
full attention, zero-centred norms and a dense layer among its MoE layers; DeepSeek-V3 with multi-latent attention,
grouped sigmoid routing, shared experts and a dense first layer, and again with YaRN RoPE;
GLM-4.7-Flash (DeepSeek-V3's decoder with mlp_layer_types and one expert group) and Kimi-K2
(DeepSeek-V3's config.json as model_type kimi_k2, YaRN in rope_scaling); MiMo
(Qwen2 with MTP layers) and DeepSeek-V3 with an MTP layer, built without it, and built with it by
--mtp-num-layers 1 (MiMo trained with and without --enable-mtp-training; DeepSeek-V3, GLM-4.5 and
GLM-4.7-Flash converted)): build the actor from HF
weights, export back to HF names (bit-exact, every HF tensor), compare logits with transformers
(fp32, 1e-5), write an HF directory with save_hf (the source's config.json kept as it was). See
tests/support/train_checks/check_model.py.

CHECK_MODEL_FAMILIES=a,b (check_model.py's family names) launches the check for those families
only and skips the tests of the others (e.g. CHECK_MODEL_FAMILIES=glm4_moe_lite,kimi_k2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

# One launch builds 14 families x 3 layouts (3 more at CP=2) and trains six of them.
pytestmark = pytest.mark.timeout(1500)

LAYOUTS = ["dp2", "tp2", "pp2"]
MTP_FAMILIES = [
    "mimo_mtp",
    "mimo_mtp_frozen",
    "deepseek_v3_mtp_built",
    "glm4_moe_mtp_built",
    "glm4_moe_lite_mtp_built",
]
ETP_FAMILIES = ["qwen3_moe", "deepseek_v3"]  # check_model.ETP_FAMILIES
MOE_FAMILIES = [
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "minimax_m2",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "deepseek_v3_mtp",
    "deepseek_v3_mtp_built",
    "glm4_moe_mtp_built",
    "glm4_moe_lite",
    "kimi_k2",
    "glm4_moe_lite_mtp_built",
    "qwen3_next",
    "qwen3_5_moe",
    "glm_moe_dsa",
    "deepseek_v32",
]
FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_tied",
    "glm4",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "minimax_m2",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "glm4_moe_lite",
    "kimi_k2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    # DeepSeek sparse attention: GLM-5 (interleaved indexer RoPE, shared layers) and DeepSeek-V3.2.
    "glm_moe_dsa",
    "deepseek_v32",
    # Checkpoints carrying multi-token-prediction layers, built without them (no --mtp-num-layers),
    # as slime does: the MTP tensors are neither loaded nor exported (round trip and save_hf
    # compare every other tensor; save_hf's names equal the source's without the MTP ones).
    "mimo",
    "deepseek_v3_mtp",
    # The same checkpoints built with their MTP layer (--mtp-num-layers 1): every HF tensor round
    # trips, the MTP layer's included (DeepSeek's MTP copies of the embedding and head excepted:
    # Megatron's MTP block uses the model's).
    *MTP_FAMILIES,
]


ONLY = [f for f in os.environ.get("CHECK_MODEL_FAMILIES", "").split(",") if f]
# Tests of one family that take no `family` parameter.
FIXED_FAMILY = {
    "test_mtp_training_step_trains_the_mtp_layer": "mimo_mtp",
    "test_mtp_training_is_the_same_at_tp2_and_pp2": "mimo_mtp",
    "test_without_mtp_training_the_mtp_layer_stays_as_loaded": "mimo_mtp_frozen",
    "test_allgather_cp_layout_equals_the_others": "glm_moe_dsa",
    "test_freeze_indexer_keeps_the_indexer_as_loaded": "glm_moe_dsa",
}


@pytest.fixture(autouse=True)
def _only_selected_families(request: pytest.FixtureRequest) -> None:
    if not ONLY:
        return
    callspec = getattr(request.node, "callspec", None)
    family = (callspec.params.get("family") if callspec else None) or FIXED_FAMILY.get(
        request.node.originalname
    )
    if family is not None and family not in ONLY:
        pytest.skip(f"CHECK_MODEL_FAMILIES={','.join(ONLY)}")


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("train_model")
    log = work / "torchrun.log"
    rc = torchrun("check_model.py", str(work), *ONLY, log=log, timeout=1200)
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


@pytest.mark.parametrize(
    ("layout", "family"),
    [
        (lay, fam)
        for lay in ("tp2", "pp2", "ep2")
        for fam in ("qwen3_moe", "deepseek_v3", "minimax_m2", "qwen3_next", "qwen3_5_moe", "glm_moe_dsa")
    ]
    + [("ep2ag", "qwen3_moe")]  # Megatron's allgather dispatcher at EP=2: micro-batches padded alike
    # Experts at ETP=1 under TP=2: whole on both TP ranks (their gradients summed over the expert
    # data-parallel group, which holds them), or split over the two by EP=2.
    + [(lay, fam) for lay in ("tp2etp1", "tp2ep2etp1") for fam in ETP_FAMILIES],
)
def test_moe_training_steps_equal_across_layouts(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    # Two SFT steps: the loss (on the last stage) and the global grad norm at TP=2 (MoE there trains
    # with sequence parallelism) and PP=2 equal DP=2's: every expert's TP shard and every replicated
    # weight counted once, the gradient of MLA's shared RoPE key summed over the TP ranks, and
    # MiniMax-M2's all-head QK norms' gradient (whole on every TP rank) not summed again.
    for rank_results in checked:
        want = value(rank_results, f"dp2/{family}/train")
        got = value(rank_results, f"{layout}/{family}/train")
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)


CONTEXT_PARALLEL = ["qwen3", "deepseek_v3", "mimo_mtp", "qwen3_5", "glm_moe_dsa"]  # check_model's


@pytest.mark.parametrize("family", CONTEXT_PARALLEL)
def test_context_parallel_logits_and_training_equal_the_other_layouts(
    checked: list[dict[str, Any]], family: str
) -> None:
    # CP=2 splits every sequence over the two ranks (Megatron's load-balanced chunks; keys and values
    # gathered; MLA's and MTP's rolls across the CP ranks): the logits equal transformers', the
    # weights round trip, and two SFT steps' loss and grad norm equal DP=2's.
    for rank_results in checked:
        assert value(rank_results, f"cp2/{family}/logits") < 1e-5
        assert value(rank_results, f"cp2/{family}/round_trip")["mismatched"] == []
        want = value(rank_results, f"dp2/{family}/train")
        got = value(rank_results, f"cp2/{family}/train")
        if family != "mimo_mtp":
            assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)
            assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)
            continue
        # The first step's MTP loss over the same micro-batches as TP=2's (DP=1 in both) is the same
        # number: the labels and mask rolled across the CP ranks line up. Its gradient, as Megatron's
        # MTP does under CP, weighs each rank's tokens by that rank's count: the grad norm, and the
        # second step, are only close.
        tp2 = value(rank_results, "tp2/mimo_mtp/train")
        assert got[0]["loss"] == pytest.approx(tp2[0]["loss"], abs=2e-6)
        assert got[0]["mtp_loss"] == pytest.approx(tp2[0]["mtp_loss"], rel=1e-6)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in tp2], rel=2e-2)
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in tp2], rel=1e-3)
        assert all(m["mtp_changed"] for m in got)


def test_allgather_cp_layout_equals_the_others(checked: list[dict[str, Any]]) -> None:
    # --allgather-cp (slime's contiguous CP layout, sparse-attention models only): each CP rank holds
    # one contiguous half of every sequence, its RoPE angles and the indexer's keys taken by those
    # positions: the logits equal transformers' and two SFT steps equal DP=2's.
    for rank_results in checked:
        assert value(rank_results, "cp2ag/glm_moe_dsa/logits") < 1e-5
        want = value(rank_results, "dp2/glm_moe_dsa/train")
        got = value(rank_results, "cp2ag/glm_moe_dsa/train")
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)


def test_freeze_indexer_keeps_the_indexer_as_loaded(checked: list[dict[str, Any]]) -> None:
    # The indexer has no gradient path (its choice only masks attention): with weight decay its
    # weight matrices still shrink each step unless --freeze-indexer takes them out of the optimizer.
    for rank_results in checked:
        got = value(rank_results, "dp2/glm_moe_dsa/freeze_indexer")
        assert got["indexer_params"] == 10  # two indexer layers x wq_b, wk, k_norm (2), weights_proj
        assert got["trained"] == 6  # the three matrices of each (norms take no decay)
        assert got["frozen"] == 0
        assert got["frozen_others"] == got["trained_others"] > 0


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("family", ["glm4", "qwen3_5"])
def test_dense_training_steps_equal_across_layouts(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    # GLM-4 and Qwen3.5 dense at TP=2 with sequence parallelism and at PP=2: two SFT steps' loss and
    # grad norm equal DP=2's, so the gradients through GLM-4's norms of attention's and the MLP's
    # outputs and through Qwen3.5's linear-attention output norm (shared by the value heads TP
    # splits) are summed over TP once, like every other weight's.
    for rank_results in checked:
        want = value(rank_results, f"dp2/{family}/train")
        got = value(rank_results, f"{layout}/{family}/train")
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], abs=2e-6)


@pytest.mark.parametrize("layout", ["tp2etp1", "tp2ep2etp1"])
@pytest.mark.parametrize("family", ETP_FAMILIES)
def test_expert_tensor_parallel_apart_from_tp_builds_exports_and_matches(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    # --expert-tensor-parallel-size 1 under --tensor-model-parallel-size 2: every HF tensor exported
    # back bit-exact (the experts gathered over EP only, the dense layers over TP), the logits equal
    # transformers', and the layout is what the flags asked for.
    for rank_results in checked:
        got = value(rank_results, f"{layout}/{family}/round_trip")
        assert got["mismatched"] == [] and got["missing"] == [] and got["count"] > 0, got
        assert value(rank_results, f"{layout}/{family}/logits") < 1e-5
        assert value(rank_results, f"{layout}/{family}/layout")["etp"] == 1
    if layout == "tp2ep2etp1":
        assert value(checked[0], f"{layout}/{family}/save_hf") == {
            "diff": [],
            "names_equal": True,
            "config": True,
        }


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_parallel_build_export_and_logits(checked: list[dict[str, Any]], family: str) -> None:
    # EP=2 over gloo: each rank holds half the experts (Megatron's alltoall dispatcher); export
    # gathers them back to every HF expert tensor, bit-exact, and the logits equal transformers'.
    for rank_results in checked:
        got = value(rank_results, f"ep2/{family}/round_trip")
        assert got["mismatched"] == [] and got["missing"] == [] and got["count"] > 0, got
        assert value(rank_results, f"ep2/{family}/logits") < 1e-5
    assert value(checked[0], f"ep2/{family}/save_hf") == {"diff": [], "names_equal": True, "config": True}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_block_leaves_the_logits_unchanged(
    checked: list[dict[str, Any]], layout: str, family: str
) -> None:
    # Log-prob passes: the logits of the model with the MTP block equal (bit for bit) those of the
    # same checkpoint built without it; against transformers as every family is (above).
    diffs = [value(r, f"{layout}/{family}/mtp_logits") for r in checked]
    on_last_stage = [d for d in diffs if d is not None]
    assert on_last_stage and max(on_last_stage) == 0.0, diffs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_training_step_trains_the_mtp_layer(checked: list[dict[str, Any]], layout: str) -> None:
    # Two SFT steps with --enable-mtp-training: the MTP loss is logged (mtp_loss, mtp_1_loss), finite
    # and near ln(vocab) for a random tiny model; every MTP weight changes, as do the others.
    import math

    holders = 0
    for rank_results in checked:
        for m in value(rank_results, f"{layout}/mimo_mtp/train"):
            assert math.isfinite(m["mtp_loss"]) and 3.0 < m["mtp_loss"] < 9.0, m
            assert m["mtp_1_loss"] == m["mtp_loss"]
            if "mtp_changed" in m:  # this rank holds the MTP layer (the last stage)
                holders += 1
                assert len(m["mtp_changed"]) == m["mtp_count"] > 0, m
                assert m["others_changed"] > 0
    assert holders >= 2


def test_mtp_training_is_the_same_at_tp2_and_pp2(checked: list[dict[str, Any]]) -> None:
    # The MTP loss is a per-micro-batch token mean (as slime's), so layouts with the same micro-batches
    # (TP=2 and PP=2, one DP rank each) must agree on it, on the loss and on the grad norm.
    for rank_results in checked:
        tp = value(rank_results, "tp2/mimo_mtp/train")
        pp = value(rank_results, "pp2/mimo_mtp/train")
        for key in ("loss", "grad_norm", "mtp_loss"):
            assert [m[key] for m in pp] == pytest.approx([m[key] for m in tp], rel=1e-5), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_mtp_training_the_mtp_layer_stays_as_loaded(
    checked: list[dict[str, Any]], layout: str
) -> None:
    # --mtp-num-layers without --enable-mtp-training: no MTP loss, and the step (which changes every
    # other weight) leaves every MTP weight as it was.
    holders = 0
    for rank_results in checked:
        for m in value(rank_results, f"{layout}/mimo_mtp_frozen/train"):
            assert "mtp_loss" not in m
            if "mtp_changed" in m:
                holders += 1
                assert m["mtp_changed"] == [] and m["mtp_count"] > 0 and m["others_changed"] > 0, m
    assert holders >= 2


def test_check_script_completed(checked: list[dict[str, Any]]) -> None:
    assert all(value(r, "done") is True for r in checked)


def test_results_dir_is_per_rank(checked: list[dict[str, Any]]) -> None:
    assert len(checked) == 2 and all(isinstance(r, dict) for r in checked)
    assert Path(__file__).name.startswith("test_train_")

"""Megatron-LM's checkpoint layout, on two gloo ranks: what Megatron writes loads in tether at
another TP/PP, what tether writes loads in Megatron, TransformerEngine names load on CPU, and
resumes keep the run state. See tests/support/train_checks/check_megatron_ckpt.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("megatron_ckpt")
    log = work / "torchrun.log"
    rc = torchrun("check_megatron_ckpt.py", str(work), log=log, timeout=900)
    assert rc == 0, log.read_text()[-6000:]
    return work, [results(work / "results" / f"rank{r}.json") for r in (0, 1)]


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_a_bare_megatron_checkpoint_saved_at_tp2_ref_loads_at_tp1_and_pp2(
    checked: tuple[Path, list[dict[str, Any]]], layout: str
) -> None:
    work, ranks = checked
    for r in ranks:
        got = value(r, f"foreign/{layout}")
        assert got["used"] == str(work / "foreign" / "iter_0000007")
        assert got["weights"] == []  # every HF-named tensor equals the TP=2 model's
        assert got["log_probs_equal_hf_built"] is True  # bit for bit, same layout
        assert got["max_diff_to_tp2"] < 1e-5


def test_the_opd_teacher_loads_from_a_megatron_checkpoint_at_its_step(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    """--use-opd --opd-type megatron --opd-teacher-load DIR --opd-teacher-ckpt-step 7: the frozen teacher
    holds that checkpoint's weights (its log-probs equal a model built from the exported HF weights)."""
    for r in checked[1]:
        assert value(r, "foreign/opd_teacher") == {"frozen": True, "log_probs_equal_hf_built": True}


def test_a_megatron_checkpoint_resumes_at_its_own_tp_and_is_refused_at_another(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in checked[1]:
        got = value(r, "foreign/resume_tp2")
        # Adam's step (1: one step trained) comes back from the optimizer's param groups
        assert got == {"rollout_id": 7, "weights": [], "adam": True, "adam_step": [1, 1]}
        refused = value(r, "foreign/resume_tp1_refused")
        assert "saved at TP=2 PP=1, this run has TP=1 PP=1" in refused and "--ref-load" in refused


def test_tether_checkpoint_loads_through_dist_checkpointing_alone(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in checked[1]:
        got = value(r, "tether_save/bare_load")
        assert got["mismatched"] == [] and got["count"] > 0
        assert got["tracker"] == "3" and got["iteration"] == 3 and got["checkpoint_version"] == 3.0
        layers, hidden, heads, tp, pp, dp, add_pos, vocab = got["args"]
        assert [layers, hidden, heads] == got["config"]
        assert (tp, pp, dp, add_pos) == (1, 1, 2, False) and vocab > 0
        assert "num_steps" in got["scheduler"]
        assert got["content_metadata"] == "dp_reshardable" and got["has_optimizer"] is True


def test_resume_from_the_new_layout_keeps_state_weights_adam_and_rng(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in checked[1]:
        got = value(r, "resume/new_layout")
        state = got["state"]
        assert (state["step"], state["rollout_id"], state["weight_version"]) == (3, 3, 4)
        assert state["data_position"] == {"next": 4}
        assert got["weights"] == [] and got["adam"] is True and got["rng"] is True


def test_tethers_previous_layout_still_resumes(checked: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in checked[1]:
        got = value(r, "resume/legacy_layout")
        assert got["state"] is not None and got["state"]["rollout_id"] == 3
        assert got["weights"] == [] and got["adam"] is True


@pytest.mark.parametrize("variant", ["te", "local"])
def test_checkpoints_under_either_specs_names_load_into_the_cpu_model(
    checked: tuple[Path, list[dict[str, Any]]], variant: str
) -> None:
    for r in checked[1]:
        got = value(r, f"te_names/{variant}")
        assert got["weights"] == []
        # The "local" checkpoint really holds the old local names (loaded through the alias).
        assert bool(got["local_keys_in_ckpt"]) == (variant == "local")


def test_no_save_optim_writes_no_optimizer_and_its_resume_starts_a_fresh_one(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in checked[1]:
        got = value(r, "flags/no_save_optim")
        assert got["optimizer_tensors"] == [] and got["args_no_save_optim"] is True
        assert got["rollout_id"] == 1 and got["weights"] == [] and got["adam_step"] is None


def test_no_load_optim_and_rng_and_ckpt_step(checked: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in checked[1]:
        got = value(r, "flags/no_load_optim_rng")
        assert got == {"rollout_id": 3, "weights": [], "adam_step": None, "rng_restored": False}
        got = value(r, "flags/ckpt_step")  # the tracker names 3; --ckpt-step 2 loads 2, Adam included
        assert got == {
            "tracker": "3",
            "rollout_id": 2,
            "data_position": {"at": 2},
            "weights": [],
            "adam_step": 1,
        }


def test_async_save_returns_first_and_completes_at_finalize(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    work = checked[0]
    for r in checked[1]:
        got = value(r, "flags/async_save")
        # The save returned and a step trained while no shard was written; the resume point stayed 3.
        assert got["shards_written"] == [] and got["still_no_shards"] is True
        assert got["trained_after_save"] is True
        assert got["tracker"] == "3" and got["resume_point"] == str(work / "async" / "iter_0000003")
        # After finalize: complete, named by the tracker, with the weights of its step boundary.
        assert got["final"] == str(work / "async" / "iter_0000004") and got["tracker_after"] == "4"
        assert got["rollout_id"] == 4 and got["weights_at_save"] == [] and got["tmp_left"] is False


def test_experts_at_etp1_under_tp2_resume_and_load_at_tp1(checked: tuple[Path, list[dict[str, Any]]]) -> None:
    # slime's MoE layout (--expert-tensor-parallel-size 1 under TP=2): saved in torch_dist, it
    # resumes at that layout with every weight and Adam's state, and reshards to TP=1 on load.
    _, ranks = checked
    for r in ranks:
        assert value(r, "expert_layout/resume") == {"loaded": True, "weights": [], "adam": True, "etp": 1}
        assert value(r, "expert_layout/tp1_weights") == []


def test_slimes_qwen3_5_checkpoint_loads_into_gated_delta_net(
    checked: tuple[Path, list[dict[str, Any]]],
) -> None:
    # slime's spec keeps transformers' linear attention (HF tensors under self_attention.linear_attn.*);
    # tether converts them into Megatron's GatedDeltaNet on load, at TP 1 and split over TP 2.
    for r in checked[1]:
        assert value(r, "slime_linear_attention/tp1") == []
        assert value(r, "slime_linear_attention/tp2") == []


def test_glm5_sparse_attention_resumes_and_loads_at_pp2(checked: tuple[Path, list[dict[str, Any]]]) -> None:
    # GLM-5's indexers (slime's names directly under self_attention, whole on every TP rank) are in
    # the torch_dist checkpoint: a TP=2 save resumes with weights and Adam state and loads at PP=2.
    for r in checked[1]:
        assert value(r, "sparse_attention/resume") == {
            "loaded": True,
            "weights": [],
            "adam": True,
            "indexer": [
                "self_attention.weights_proj.weight",
                "self_attention.wk.weight",
                "self_attention.wq_b.weight",
            ],
        }
        assert value(r, "sparse_attention/pp2_weights") == []


def test_every_check_ran(checked: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in checked[1]:
        for name in (
            "foreign",
            "tether_save",
            "te_names",
            "flags",
            "expert_layout",
            "slime_linear_attention",
            "sparse_attention",
        ):
            assert value(r, f"{name}/done") is True
        assert value(r, "done") is True

"""Megatron flags on CPU with real Megatron (one torchrun launch of train_checks/check_flags.py):
recompute, per-token loss, overlapped reductions, the distributed optimizer and uneven pipeline
stages leave the numbers unchanged; bf16/fp16 train in their dtype; SGD and the LR schedule change
the steps as Megatron defines them; --seq-length refuses longer samples; sequence parallelism is
off at TP = 1 and at TP = 2 on CPU trains as TP = 2 without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.train_checks.launcher import results, torchrun, value

Runs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    work = tmp_path_factory.mktemp("megatron_flags")
    log = work / "flags.log"
    rc = torchrun("check_flags.py", str(work), log=log)
    assert rc == 0, log.read_text()[-5000:]
    return [results(Path(work) / "results" / f"rank{r}.json") for r in (0, 1)]


def losses(run: dict[str, Any]) -> list[float]:
    return [m["loss"] for m in run["metrics"]]


def grad_norms(run: dict[str, Any]) -> list[float]:
    return [m["grad_norm"] for m in run["metrics"]]


@pytest.mark.parametrize(
    ("variant", "baseline"),
    [
        ("recompute_uniform", "base"),
        ("recompute_block", "base"),
        ("recompute_selective", "base"),
        ("tp2_recompute", "tp2_base"),
    ],
)
def test_recompute_leaves_loss_and_weights_unchanged(runs: Runs, variant: str, baseline: str) -> None:
    for rank in runs:
        got, want = value(rank, variant), value(rank, baseline)
        assert got["recompute"] is not None and want["recompute"] is None
        assert losses(got) == losses(want)  # recomputation repeats the same forward, bit for bit
        assert grad_norms(got) == grad_norms(want)
        assert got["digest"] == want["digest"]


@pytest.mark.parametrize(
    "variant",
    ["per_token_loss", "overlap_grad_reduce", "distopt", "distopt_overlap", "vocab_padding", "sp_tp1"],
)
def test_same_numbers_another_way(runs: Runs, variant: str) -> None:
    for rank in runs:
        got, base = value(rank, variant), value(rank, "base")
        assert losses(got) == pytest.approx(losses(base), abs=2e-6)
        assert grad_norms(got) == pytest.approx(grad_norms(base), rel=1e-5)
        # The weights after the last step, read as weight sync reads them: with the overlapped
        # all-gather they are gathered before the read.
        for name, v in base["digest"].items():
            assert got["digest"][name] == pytest.approx(v, rel=1e-5), name
    rank0 = value(runs[0], variant)
    assert rank0["per_token"] is (variant == "per_token_loss")
    assert rank0["padded_vocab"] == (384 if variant == "vocab_padding" else 320)
    assert rank0["sequence_parallel"] is False  # Megatron turns it off at TP = 1


def test_grad_norm_and_clipping_at_tp2_equal_tp1(runs: Runs) -> None:
    # Megatron's grad norm is the L2 norm over the full model's unique parameters: each TP shard
    # counted once, replicated weights (norms) once. Every sharded weight carries its TP attributes
    # (4 layers x qkv, proj, fc1, fc2 + embedding + output layer), at TP = 1 as at TP = 2.
    for rank in runs:
        for variant in ("base", "tp2_base", "sgd_clip", "tp2_sgd_clip"):
            assert value(rank, variant)["tp_params"] == 4 * 4 + 2, variant
        for tp2, tp1 in (("tp2_base", "base"), ("tp2_sgd_clip", "sgd_clip")):
            got, want = value(rank, tp2), value(rank, tp1)
            assert grad_norms(got) == pytest.approx(grad_norms(want), rel=1e-4), tp2
            assert losses(got) == pytest.approx(losses(want), abs=2e-6), tp2
        clipped, tp1 = value(rank, "tp2_sgd_clip"), value(rank, "sgd_clip")
        assert all(norm > 2 * 0.5 for norm in grad_norms(clipped))  # --clip-grad 0.5 really clips
        # Clipping scales the SGD step by 0.5 / norm: with the TP = 1 norm, the same weights.
        for name, v in tp1["digest"].items():
            assert clipped["digest"][name] == pytest.approx(v, rel=1e-5), name
        # ... and not those of the run clipped at 1.0 (the default), so the digest sees the clip.
        assert tp1["digest"] != value(rank, "sgd")["digest"]


def test_uneven_pipeline_stages(runs: Runs) -> None:
    assert [value(r, "pp2_uneven")["stage_layers"] for r in runs] == [1, 3]
    assert [value(r, "pp2_even")["stage_layers"] for r in runs] == [2, 2]
    for rank in runs:
        uneven, base = value(rank, "pp2_uneven"), value(rank, "base")
        assert losses(uneven) == pytest.approx(losses(base), abs=2e-6)


@pytest.mark.parametrize(("variant", "dtype"), [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_mixed_precision_trains_in_its_dtype(runs: Runs, variant: str, dtype: str) -> None:
    for rank in runs:
        got, base = value(rank, variant), value(rank, "base")
        assert got["dtype"] == dtype
        assert losses(got) != losses(base)  # really another precision
        assert losses(got) == pytest.approx(losses(base), rel=2e-3)
        # fp16's loss scale (2^16) is divided out again: the norm is the true gradient's.
        assert grad_norms(got) == pytest.approx(grad_norms(base), rel=2e-2)
        assert all(m["step_applied"] == 1.0 for m in got["metrics"])


def test_sgd_steps_differ_from_adam(runs: Runs) -> None:
    for rank in runs:
        sgd, base = value(rank, "sgd"), value(rank, "base")
        assert losses(sgd)[0] == losses(base)[0]
        assert losses(sgd)[1] != pytest.approx(losses(base)[1], abs=1e-5)


def test_lr_schedule_warms_up_then_decays(runs: Runs) -> None:
    # --lr-warmup-iters 1 from --lr-warmup-init 0, then linear to --min-lr over --train-iters 4.
    lrs = [m["lr"] for m in value(runs[0], "schedule")["metrics"]]
    assert lrs == pytest.approx([0.0, 3e-3, 1e-4 + (2 / 3) * (3e-3 - 1e-4)])
    assert [m["lr"] for m in value(runs[0], "base")["metrics"]] == pytest.approx([3e-3] * 3)


def test_refusals_name_flag_and_value(runs: Runs) -> None:
    too_long = value(runs[0], "too_long")
    assert too_long.startswith("ConfigError: --seq-length=8:") and "12 tokens" in too_long


def test_sequence_parallel_at_tp2_on_cpu_trains_as_without(runs: Runs) -> None:
    # Megatron's local norms refuse sequence parallelism; tether's local spec uses norms that accept
    # it (their weight gradients are summed over TP by finalize_model_grads), so it runs on CPU.
    for rank in runs:
        got, base = value(rank, "tp2_sequence_parallel"), value(rank, "tp2_base")
        assert got["sequence_parallel"] is True and base["sequence_parallel"] is False
        assert losses(got) == pytest.approx(losses(base), abs=2e-6)
        assert grad_norms(got) == pytest.approx(grad_norms(base), rel=1e-5)
        for name, v in base["digest"].items():
            assert got["digest"][name] == pytest.approx(v, rel=1e-5), name


def test_offload_round_trip_between_steps_changes_nothing(runs: Runs) -> None:
    # The storages --offload-train moves (weights, DDP buffers, main grads, optimizer state) go
    # out and come back between steps; training continues exactly as without.
    for rank in runs:
        for variant, baseline in (("round_trip", "base"), ("round_trip_distopt_bf16", "distopt_bf16")):
            got, want = value(rank, variant), value(rank, baseline)
            assert all(moved > 2 * got["param_bytes"] for moved in got["moved_bytes"])  # + grads, state
            assert losses(got) == losses(want)
            assert got["digest"] == want["digest"]

"""`tether run` end to end on CPU: every loop mode and every weight-sync transport, a few steps each.

Each run starts real processes (a CPU engine, Megatron ranks under torchrun, the supervisor)
on 127.0.0.1 and checks what the run records: the ledger's versions, the engines' served
versions, finite losses, weights that change, the receipt, and each sample's version lag;
and that each ended cleanly: every trainer and engine process exited 0, the trainer ranks
because they were asked to, so `logs/` holds no error file.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support.e2e import STEPS, Workspace, check_clean_exit, check_run, jsonl, tether


def test_sync_loop_disk_tp2_and_receipt(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    run = run_dir
    weights = tmp_path / "weights"
    tether(
        "run",
        *ws.flags(
            run,
            "--num-rollout",
            str(STEPS),
            "--tensor-model-parallel-size",
            "2",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(weights),
            "--update-weight-disk-keep-files",
        ),
    )
    metrics = check_run(run, transport="disk")
    assert all(m["rollout/version_lag_max"] == 0 for m in metrics)  # sync: always the newest weights
    # A fresh run from --hf-checkpoint: the engines serve the weights the trainers start from,
    # so the first rollout generated while the trainer ranks started, and trained on-policy.
    events = [e["event"] for e in jsonl(run / "events.jsonl")]
    assert events.index("rollout_started_early") < events.index("ready")
    first = load_file(str(weights / "weight_v000001" / "model-00001-of-00001.safetensors"))
    last = load_file(str(weights / f"weight_v{STEPS:06d}" / "model-00001-of-00001.safetensors"))
    base = load_file(str(ws.model / "model.safetensors"))
    assert any(not (first[k] == base[k]).all() for k in base), "the first sync published unchanged weights"
    assert any(not (last[k] == first[k]).all() for k in base), "training did not change the weights"
    receipt = __import__("json").loads((run / "receipt.json").read_text())
    assert receipt["config"]["megatron"]["tensor_model_parallel_size"] == 2
    assert receipt["plan"]["train_groups"][0]["world_size"] == 2
    assert receipt["versions"]["torch"].startswith("2.") and "megatron-core" in receipt["versions"]
    assert receipt["hosts"]["head"] and "git_revision" in receipt
    assert (run / "logs" / "engine0.log").exists() and (run / "logs" / "trainer-node0.log").exists()


@pytest.mark.parametrize(
    ("transport", "parallel"),
    [("distributed", "tensor"), ("delta", "tensor"), ("distributed", "pipeline"), ("distributed", "context")],
    ids=["distributed-tp2", "delta-tp2", "distributed-pp2", "distributed-cp2"],
)
def test_sync_loop_model_parallel_engine_serves_the_trainers_weights(
    ws: Workspace, tmp_path: Path, run_dir: Path, transport: str, parallel: str
) -> None:
    """After every sync the engine's log-probs of the step's tokens equal the trainer's, with
    the model split over two ranks (TP: gathered shards; PP: the second stage streamed; CP: each
    sequence split, one of the two replicas the sync source)."""
    run = run_dir
    flag = "--context-parallel-size" if parallel == "context" else f"--{parallel}-model-parallel-size"
    flags = ["--num-rollout", str(STEPS), flag, "2"]
    if transport == "distributed":
        flags += ["--update-weight-transport", "nccl"]
    else:
        flags += ["--update-weight-mode", "delta", "--update-weight-transport", "disk"]
        flags += ["--update-weight-disk-dir", str(tmp_path / "w")]
        flags += ["--update-weight-local-checkpoint-dir", str(tmp_path / "local")]
    tether("run", *ws.flags(run, *flags))
    metrics = check_run(run, transport=transport)
    assert all(m["rollout/version_lag_max"] == 0 for m in metrics)  # so check_run compared every step
    if transport == "distributed" and parallel == "pipeline":
        # Each stage's sync source broadcast its own tensors over its own group, as slime does.
        joined = (run / "logs" / "engine0.log").read_text()
        assert "group 'tether-weights-pp0-" in joined and "group 'tether-weights-pp1-" in joined


def test_async_loop_distributed_dp2(ws: Workspace, run_dir: Path) -> None:
    run = run_dir
    flags = ["--num-rollout", str(STEPS), "--loop", "async", "--update-weight-transport", "nccl"]
    tether("run", *ws.flags(run, *flags, "--keep-old-actor"))
    metrics = check_run(run, transport="distributed")
    # async: rollout N+1 is made while N trains, so from the second step samples lag one version
    assert [m["rollout/version_lag_max"] for m in metrics] == [0.0] + [1.0] * (STEPS - 1)
    # --keep-old-actor (slime's one-step-off queue at --update-weights-interval 1): the old
    # log-probs come from the weights each rollout was generated with, so they equal the
    # engine's on every step, the lagging ones too.
    assert all(m["train/train_rollout_logprob_abs_diff"] < 1e-4 for m in metrics)


def test_fully_async_loop_delta(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    run = run_dir
    tether(
        "run",
        *ws.flags(
            run,
            "--num-rollout",
            str(STEPS),
            "--loop",
            "fully-async",
            "--update-weight-mode",
            "delta",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
            "--update-weight-local-checkpoint-dir",
            str(tmp_path / "local"),
        ),
    )
    metrics = check_run(run, transport="delta")
    assert all("fully_async/queue_length" in m for m in metrics)
    assert "rollout_started_early" in [e["event"] for e in jsonl(run / "events.jsonl")]  # the warm worker


# TP 2: each engine rank takes its own device's trainer rank's handles. PP 2: each trainer rank holds
# one stage, and every stage's tensors reach both ranks before the handles are shared.
@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"])
def test_colocated_tensor_handles(ws: Workspace, run_dir: Path, layout: str) -> None:
    run = run_dir
    flags = ws.flags(run, "--num-rollout", str(STEPS), "--colocate", layout, "2")
    flags[flags.index("--cpu-devices") + 1] = "2"
    flags[flags.index("--rollout-num-gpus") + 1] = "2"
    tether("run", *flags)
    metrics = check_run(run, transport="tensor")
    assert all(m["rollout/version_lag_max"] == 0 for m in metrics)


def test_debug_rollout_only_then_train_only_ci_checks_and_plot(ws: Workspace, tmp_path: Path) -> None:
    dumps = str(tmp_path / "dump_{rollout_id}.msgpack")
    gen = tmp_path / "gen"
    tether(
        "run",
        *ws.flags(gen, "--num-rollout", "2", "--debug-rollout-only", "--save-debug-rollout-data", dumps),
    )
    assert sorted(p.name for p in tmp_path.glob("dump_*.msgpack")) == ["dump_0.msgpack", "dump_1.msgpack"]
    assert not (gen / "logs" / "trainer-node0.log").exists()  # no trainer was started
    check_clean_exit(gen)
    train = tmp_path / "train"
    details = tmp_path / "details"
    tether(
        "run",
        *ws.flags(train, "--num-rollout", "2", "--debug-train-only", "--load-debug-rollout-data", dumps),
        "--dump-details",
        str(details),
        "--ci-save-grad-norm",
        str(tmp_path / "grad_norm" / "{role}_{rollout_id}_{step_id}.pt"),
    )
    assert not (train / "logs" / "engine0.log").exists()  # no engine was started
    # --dump-details: slime's layout; the train data is every DP rank's shard of what was trained on
    from tether.rollout.debug_dump import load_rollout
    from tether.run.train_dump import load_train_data

    assert (details / "tokenizer" / "tokenizer_config.json").is_file()
    for rollout_id in (0, 1):
        dumped = load_train_data(details / "train_data" / f"{rollout_id}.msgpack")
        groups = load_rollout(dumps, rollout_id).groups
        assert dumped.rollout_id == rollout_id and len(dumped.steps) == 1
        shards = dumped.steps[0]
        assert len(shards) == 2  # DP=2
        tokens = sorted(tuple(s.tokens) for g in groups for s in g)
        got = sorted(
            tuple(int(t) for t in shard["tokens"][a:b])
            for shard in shards
            for a, b in zip(shard["offsets"][:-1], shard["offsets"][1:], strict=True)
        )
        assert got == tokens
        assert all(shard["advantages"].shape == shard["loss_masks"].shape for shard in shards)
        assert (details / "rollout_data" / f"{rollout_id}.msgpack").is_file()
    check_clean_exit(train)
    metrics = [m for m in jsonl(train / "metrics.jsonl") if m["step"] >= 0]
    assert len(metrics) == 2 and all(math.isfinite(m["train/loss"]) for m in metrics)
    done = tether("plot", str(train))
    for name in ("curves.png", "reward.png"):
        png = train / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in done.stdout
    # slime's CI checks: the same training again compares its grad norms with the saved ones
    # (slime's files: torch.save of each step's float); --ci-test stops a run whose checks fail,
    # here rollout 0's mean log-prob (the tiny model's is far below slime's -1 bound), before training:
    # no step is recorded as trained.
    saved = sorted(p.name for p in (tmp_path / "grad_norm").iterdir())
    assert saved == ["actor_0_0.pt", "actor_1_0.pt"]
    template = str(tmp_path / "grad_norm" / "{role}_{rollout_id}_{step_id}.pt")
    replay = ("--num-rollout", "2", "--debug-train-only", "--load-debug-rollout-data", dumps)
    tether("run", *ws.flags(tmp_path / "again", *replay, "--ci-load-grad-norm", template))
    # KL reward shaping runs the actor's and the reference's log-prob passes (as slime's: no on-policy
    # shortcut with --kl-coef); at rollout 0 they are equal, as the check before the bound wants.
    kl = ("--kl-coef", "0.01")
    failed = tether("run", *ws.flags(tmp_path / "ci", *replay, *kl, "--ci-test"), check=False)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "--ci-test check failed: rollout 0: rollout/log_probs=" in failed.stderr
    assert "is outside (-1, 0)" in failed.stderr
    assert not (tmp_path / "ci" / "samples.jsonl").exists() or not jsonl(tmp_path / "ci" / "samples.jsonl")


@pytest.mark.sglang
def test_sglang_router_in_front_of_the_engine(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    """--use-sglang-router: the real sglang-router (from the SGLang venv) routes every rollout."""
    from support.engines import find_sglang_python

    python, missing = find_sglang_python()
    if python is None:
        pytest.skip(f"real SGLang unavailable: {missing}")
    run = run_dir
    tether(
        "run",
        *ws.flags(
            run,
            "--num-rollout",
            "2",
            "--use-sglang-router",
            "--update-weight-transport",
            "disk",
            "--update-weight-disk-dir",
            str(tmp_path / "w"),
        ),
    )
    check_run(run, transport="disk", steps=2)
    events = [e["event"] for e in jsonl(run / "events.jsonl")]
    assert "sglang_router_ready" in events
    assert (run / "logs" / "sglang-router.log").exists()

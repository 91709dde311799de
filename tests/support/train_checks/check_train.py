"""torchrun --nproc-per-node 2 check_train.py WORK_DIR PHASE [bf16]: train steps, log-probs, checkpoints.

PHASE "train": SFT steps at TP=2, PP=2, DP=2 (distributed optimizer) and CP=2 (context parallelism)
on a fixed batch (the loss must fall); log-probs of one batch in every layout; at TP=2 also chunked log-probs and one
CISPO step with slime-style TIS/reducer hooks (`rl_run`); at DP=2 a checkpoint after step 1 of 3,
the final weights recorded, then a half-written save left behind (a crash).
PHASE "resume": a fresh job loads that checkpoint (skipping the broken one), trains steps 2-3,
and records its final weights for comparison with the uninterrupted run.
"bf16": every model of the run in --bf16 (default float32). TransformerEngine's attention under
context parallelism needs it: fp32 rules out its flash and fused backends, and CP its unfused one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import common
import torch.distributed as dist

from tether.runtime.files.atomic_file import write_bytes_atomic
from tether.train.checkpoint import load_save as checkpoint
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.parallel import topology as parallel
from tether.train.rank import step

SFT = AlgorithmConfig(loss_type="sft_loss")
STEPS = 5


def options(hf_dir: Path, bf16: bool, **megatron: object) -> model.ModelOptions:
    """lr 3e-3, no weight decay, beta2 0.98, a constant LR: the settings these checks were tuned on."""
    flags: dict[str, object] = {
        "weight_decay": 0.0,
        "adam_beta2": 0.98,
        "lr_decay_style": "constant",
        "bf16": bf16,
    }
    return model.ModelOptions(
        hf_checkpoint=str(hf_dir),
        algorithm=AlgorithmConfig(lr=3e-3),
        megatron=MegatronConfig(**{**flags, **megatron}),  # type: ignore[arg-type]
    )


def reinit(tp: int, pp: int, cp: int = 1) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return parallel.init_distributed(tp, pp, seed=1234, context_parallel=cp)


def sft_run(
    hf_dir: Path,
    topo: parallel.Topology,
    results: common.Results,
    layout: str,
    distopt: bool,
    work: Path,
    bf16: bool,
) -> None:
    opts = options(
        hf_dir, bf16, use_distributed_optimizer=distopt, clip_grad=1.0, context_parallel_size=topo.cp_size
    )
    actor = model.build_actor(opts, topo)
    attention = {
        type(m).__name__ for m in actor.chunks[0].modules() if "DotProductAttention" in type(m).__name__
    }
    results.set(f"{layout}/attention", sorted(attention))
    results.set(f"{layout}/params_dtype", str(actor.config.params_dtype))
    batch = common.make_batch(8, seed=5)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    lp, ent = step.compute_log_probs(
        actor.chunks, actor.config, actor.arch.vocab_size, batch.select(range(4)), [[0, 1], [2, 3]]
    )
    results.set(f"{layout}/log_probs", [float(x) for x in lp])
    results.set(f"{layout}/entropy", [float(x) for x in ent] if ent is not None else None)
    losses = []
    for _ in range(STEPS):
        metrics = step.train_step(actor, shard, plan, SFT)
        losses.append(metrics)
    results.set(f"{layout}/sft_metrics", losses)
    if layout == "tp2":
        rl_run(actor, results, work)


LOSS_HOOKS = Path(__file__).resolve().parents[1] / "slime_hooks" / "loss_hooks.py"
TIS_RATIOS = (1.0, 3.0, 0.5, 1.5)  # train/rollout ratio of response token t: TIS_RATIOS[t % 4]


def rl_run(actor: model.Actor, results: common.Results, work: Path) -> None:
    """slime's loss-side flags at TP=2 (vocab-parallel log-probs): --log-probs-chunk-size gives the
    unchunked log-probs; one CISPO step with a slime-style custom TIS hook (its YAML keys from
    --custom-config-path) and a custom pg-loss reducer, its metrics recorded against the log-probs."""
    import time

    import numpy as np

    start = time.perf_counter()
    batch = common.make_batch(8, seed=6)
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]
    lp, _ = step.compute_log_probs(actor.chunks, actor.config, actor.arch.vocab_size, batch, plan)
    chunked, _ = step.compute_log_probs(
        actor.chunks, actor.config, actor.arch.vocab_size, batch, plan, step.StepOptions(chunk_size=3)
    )
    results.set("tp2/chunked_log_probs_max_diff", float(np.abs(lp - chunked).max()))
    ratios = np.resize(np.array(TIS_RATIOS), lp.shape[0])
    batch.rollout_log_probs = (lp - np.log(ratios)).astype(np.float32)
    batch.advantages = np.repeat(np.where(np.arange(8) % 2 == 0, 1.0, -1.0), batch.response_lengths).astype(
        np.float32
    )
    config = work / "tis.yaml"
    # Every rank writes it: atomically, so that no rank reads it while another truncates it.
    write_bytes_atomic(config, b"cap: 2.0\nfloor: 0.75\n")
    algo = AlgorithmConfig(
        advantage_estimator="cispo",
        eps_clip=1.0,
        eps_clip_high=0.5,
        use_tis=True,
        custom_tis_function_path=f"{LOSS_HOOKS}:reject_tis",
        custom_pg_loss_reducer_function_path=f"{LOSS_HOOKS}:masked_sum_reducer",
        custom_config_path=str(config),
        log_probs_chunk_size=3,
        lr=3e-3,
    )
    metrics = step.train_step(actor, batch, plan, algo)
    results.set("tp2/rl_inputs", {"log_probs": lp.tolist(), "advantages": batch.advantages.tolist()})
    results.set("tp2/rl_metrics", metrics)
    results.set("tp2/rl_seconds", time.perf_counter() - start)  # what this addition costs the launch


def checkpoint_run(
    hf_dir: Path, topo: parallel.Topology, results: common.Results, work: Path, phase: str, bf16: bool
) -> None:
    opts = options(hf_dir, bf16, use_distributed_optimizer=True)
    ckpt = work / "ckpt"
    if phase == "train":
        actor = model.build_actor(opts, topo)
        first = 1
    else:
        actor = model.build_actor(opts, topo, load_weights=False)
        state = checkpoint.load(actor, ckpt)
        assert state is not None, "no checkpoint found"
        results.set(
            "resume/state",
            {
                "step": state.step,
                "rollout_id": state.rollout_id,
                "data": state.data_position,
                "weight_version": state.weight_version,
            },
        )
        first = int(state.data_position["next_step"])
        # A frozen reference from --ref-load: the same checkpoint's weights, no optimizer.
        ref = model.build_reference(opts, topo, load_weights=False)
        checkpoint.load_weights_only(ref.chunks, ckpt)
        results.set(
            "resume/ref_equals_actor",
            common.params_digest(ref.chunks, ref.arch) == common.params_digest(actor.chunks, actor.arch),
        )
        results.set("resume/ref_frozen", all(not p.requires_grad for p in ref.chunks[0].parameters()))
    for k in range(first, 4):
        batch = common.make_batch(8, seed=100 + k)
        shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
        step.train_step(actor, shard, plan, SFT)
        if phase == "train" and k == 1:
            checkpoint.save(
                actor,
                ckpt,
                checkpoint.RunState(step=1, rollout_id=1, weight_version=1, data_position={"next_step": 2}),
            )
    results.set(f"{phase}/digest", common.params_digest(actor.chunks, actor.arch))
    if phase == "train":
        dist.barrier()
        if topo.rank == 0:
            # A crash mid-save of step 2: a partial temp dir; and a directory missing its run state.
            (ckpt / "iter_0000002.tmp" / "tether").mkdir(parents=True)
            (ckpt / "iter_0000003" / "tether").mkdir(parents=True)
            (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
        dist.barrier()


def main() -> None:
    work, phase = Path(sys.argv[1]), sys.argv[2]
    precision = sys.argv[3] if len(sys.argv) > 3 else "fp32"
    if precision not in ("fp32", "bf16"):
        raise SystemExit(f"precision {precision!r}: fp32 or bf16")
    bf16 = precision == "bf16"
    rank = int(os.environ["RANK"])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", rank)
    results.path = work / "results" / f"{phase}-rank{rank}.json"
    if rank == 0:
        common.make_models(work / "models")
    dist_ready = False
    if phase == "train":
        for layout, (tp, pp, cp, distopt) in {
            "tp2": (2, 1, 1, False),
            "pp2": (1, 2, 1, False),
            "dp2": (1, 1, 1, True),
            "cp2": (1, 1, 2, False),
        }.items():
            topo = reinit(tp, pp, cp)
            if not dist_ready:
                dist.barrier()
                dist_ready = True
            hf = common.make_models(work / "models")["llama"]
            results.record(
                f"{layout}/run",
                lambda h=hf, t=topo, lay=layout, d=distopt: sft_run(h, t, results, lay, d, work, bf16),
            )
            dist.barrier()
    topo = reinit(1, 1)
    dist.barrier()
    hf = common.make_models(work / "models")["llama"]
    results.record(f"{phase}/checkpoint", lambda: checkpoint_run(hf, topo, results, work, phase, bf16))
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

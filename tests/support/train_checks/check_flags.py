"""torchrun --nproc-per-node 2 check_flags.py WORK_DIR: Megatron flags change training as Megatron means.

One launch, a 4-layer tiny Llama, three SFT steps per variant on the same batches. Each variant
records per-step metrics (loss, grad norm, lr), the dtype of its parameters, the padded vocabulary,
and a digest of the weights after the last step (read back the way weight sync reads them).

- DP=2: the baseline; activation recompute (full uniform, full block, selective); Megatron's
  per-token loss normalization; the overlapped gradient reduction; the distributed optimizer with
  and without the overlapped parameter all-gather; bf16; fp16 with dynamic loss scaling; SGD; a
  linearly decaying LR with warm-up; vocabulary padding; a sample longer than --seq-length.
- DP=2: the storage round trip --offload-train makes on a GPU (host to host here) between steps.
- TP=2: baseline, full recompute, and SGD with --clip-grad below the gradient norm (its DP=2 twin
  is `sgd_clip`): the grad norm and the clipped step must equal TP=1's.
  PP=2: even stages, and uneven ones (1 + 3 layers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist

from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.parallel import topology as parallel
from tether.train.rank import step
from tether.train.state import offload

SFT = AlgorithmConfig(loss_type="sft_loss", lr=3e-3)
STEPS = 3
BASE: dict[str, object] = {"weight_decay": 0.0, "adam_beta2": 0.98, "lr_decay_style": "constant"}

DP2: dict[str, dict[str, object]] = {
    "base": {},
    "recompute_uniform": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "recompute_block": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
    },
    "recompute_selective": {"recompute_granularity": "selective"},
    "per_token_loss": {"calculate_per_token_loss": True},
    "overlap_grad_reduce": {"overlap_grad_reduce": True},
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "bf16": {"bf16": True},
    "distopt_bf16": {"use_distributed_optimizer": True, "bf16": True},
    "fp16": {"fp16": True, "initial_loss_scale": 65536.0},
    "sgd": {"optimizer": "sgd", "adam_beta2": 0.999},
    # The first step's grad norm is ~3.2: clipped to 0.5. SGD's update scales with the clip factor
    # (Adam's would not), so a wrong norm shows in the weights.
    "sgd_clip": {"optimizer": "sgd", "adam_beta2": 0.999, "clip_grad": 0.5},
    "schedule": {"lr_decay_style": "linear", "train_iters": 4, "lr_warmup_iters": 1, "min_lr": 1e-4},
    "vocab_padding": {"make_vocab_size_divisible_by": 128},
}
OFFLOAD: dict[str, dict[str, object]] = {
    "round_trip": {},
    "round_trip_distopt_bf16": {"use_distributed_optimizer": True, "bf16": True},
}
TP2: dict[str, dict[str, object]] = {
    "tp2_base": {"tensor_model_parallel_size": 2},
    "tp2_recompute": {
        "tensor_model_parallel_size": 2,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "tp2_sgd_clip": {
        "tensor_model_parallel_size": 2,
        "optimizer": "sgd",
        "adam_beta2": 0.999,
        "clip_grad": 0.5,
    },
}
PP2: dict[str, dict[str, object]] = {
    "pp2_even": {"pipeline_model_parallel_size": 2},
    "pp2_uneven": {
        "pipeline_model_parallel_size": 2,
        "decoder_first_pipeline_num_layers": 1,
        "decoder_last_pipeline_num_layers": 3,
    },
}


def reinit(tp: int, pp: int) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return parallel.init_distributed(tp, pp, seed=1234)


def options(hf: Path, flags: dict[str, object]) -> model.ModelOptions:
    return model.ModelOptions(
        hf_checkpoint=str(hf),
        algorithm=SFT,
        megatron=MegatronConfig(**{**BASE, **flags}),  # type: ignore[arg-type]
    )


def run(
    hf: Path, topo: parallel.Topology, flags: dict[str, object], round_trip: bool = False
) -> dict[str, Any]:
    """`round_trip`: between steps, every storage --offload-train moves on a GPU goes through the same
    copy-out, shrink, grow, copy-in (host to host here), with real Megatron DDP and optimizers."""
    actor = model.build_actor(options(hf, flags), topo)
    metrics = []
    moved = []
    for k in range(STEPS):
        batch = common.make_batch(8, seed=10 + k)
        shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
        m = step.train_step(actor, shard, plan, SFT)
        metrics.append(
            {key: m[key] for key in ("loss", "grad_norm", "lr", "step_applied", "trainable_tokens")}
        )
        if round_trip:
            state = offload.offload_storages(offload.collect_storages(offload.trainer_tensors(actor), "cpu"))
            moved.append(state.nbytes)
            offload.onload_storages(state)
    inner = model.unwrap(actor.chunks[0])
    return {
        "metrics": metrics,
        "digest": common.params_digest(actor.chunks, actor.arch),
        "dtype": str(next(inner.parameters()).dtype),
        "padded_vocab": actor.arch.padded_vocab_size(topo.tp_size),
        "recompute": actor.config.recompute_granularity,
        "per_token": actor.config.calculate_per_token_loss,
        "sequence_parallel": actor.config.sequence_parallel,
        "stage_layers": len(inner.decoder.layers),
        "moved_bytes": moved,
        "param_bytes": sum(p.numel() * p.element_size() for p in inner.parameters()),
        # Weights Megatron's grad norm counts on every TP rank (the others: on TP rank 0 only).
        "tp_params": sum(bool(getattr(p, "tensor_model_parallel", False)) for p in inner.parameters()),
    }


def too_long(hf: Path, topo: parallel.Topology) -> str:
    actor = model.build_actor(options(hf, {"seq_length": 8}), topo)
    batch = common.make_batch(8, seed=10)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    try:
        step.train_step(actor, shard, plan, SFT)
    except Exception as exc:  # the refusal is what this check records
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main() -> None:
    work = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", rank)
    hf = work / "model"
    if rank == 0 and not (hf / "config.json").exists():
        from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

        write_tiny_model(hf, TinyModelSpec(layers=4, seed=3))
    for layout, variants in (((1, 1), DP2), ((2, 1), TP2), ((1, 2), PP2)):
        topo = reinit(*layout)
        dist.barrier()
        for name, flags in variants.items():
            results.record(name, lambda f=flags, t=topo: run(hf, t, f))
            dist.barrier()
        if layout == (1, 1):
            results.record("too_long", lambda t=topo: too_long(hf, t))
            # Megatron-LM turns sequence parallelism off at TP = 1: accepted, off.
            results.record("sp_tp1", lambda t=topo: run(hf, t, {"sequence_parallel": True}))
            for name, flags in OFFLOAD.items():
                results.record(name, lambda t=topo, f=flags: run(hf, t, f, round_trip=True))
            dist.barrier()
        if layout == (2, 1):
            sp = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
            # The local spec's norms accept sequence parallelism (tether.train.model.spec).
            results.record("tp2_sequence_parallel", lambda t=topo, f=sp: run(hf, t, f))
            dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

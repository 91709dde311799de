"""torchrun --nproc-per-node 2 check_routing_replay.py WORK_DIR: MoE routing replay through tether's
real log-prob pass and train step (tether.train.rank.step) on a tiny Megatron MoE GPT, at DP=2 and PP=2.

The samples carry rollout routed experts (random, [len(tokens)-1, layers, topk]) and go through the
trainer's own data path: Samples -> build_train_batch -> DP shards -> micro-batch plan.

R3 (--use-rollout-routing-replay): the actor's log-probs with the given experts must equal a
reference forward forced to the same experts by Megatron's own RouterReplay, micro-batch by
micro-batch (target indices built here from the samples, independently of tether's layout code);
they must differ from normal routing; an SFT step with replay must report the NLL of those
log-probs (the training forward used the given experts) and consume every entry.

R2 (--use-routing-replay): the log-prob pass records; the router weights are then changed (so
their own choice moves), and an SFT step with replay must report the NLL of a reference forward
forced to the *recorded* experts with the changed weights, not that of normal routing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import common
import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for support.*

from support import moe_model as mm
from tether.rollout.sample import RoutedExperts, Sample, SampleStatus
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import megatron_args
from tether.train.model.build import unwrap
from tether.train.parallel import topology as parallel
from tether.train.parallel.routing_replay import RoutingReplay
from tether.train.rank import step
from tether.train.rank.batching import build_train_batch, plan_micro_batches, shard_for_data_parallel

SFT = AlgorithmConfig(loss_type="sft_loss", lr=1e-3)
LAYERS = 2


def reinit(pp: int) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return parallel.init_distributed(1, pp, seed=1234)


def samples(n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, response = int(rng.integers(3, 7)), int(rng.integers(3, 7))
        tokens = [int(t) for t in rng.integers(0, mm.VOCAB, prompt + response)]
        # Distinct experts per token and layer, like an engine's top-k.
        experts = np.argsort(rng.random((len(tokens) - 1, LAYERS, mm.EXPERTS)), axis=-1)[..., : mm.TOPK]
        out.append(
            Sample(
                index=i,
                group_index=i // 2,
                rollout_id=i,
                tokens=tokens,
                response_length=response,
                loss_mask=[1] * response,
                rollout_log_probs=[-1.0] * response,
                reward=0.0,
                status=SampleStatus.COMPLETED,
                rollout_routed_experts=RoutedExperts.from_array(experts),
            )
        )
    return out


def build(topo: parallel.Topology, *, megatron_replay: bool = False) -> Any:
    config = mm.moe_config(LAYERS, pp=topo.pp_size, moe_enable_routing_replay=megatron_replay)
    return config, mm.moe_model(
        config, pre_process=topo.is_first_stage, post_process=topo.is_last_stage, seed=7
    )


def actor(topo: parallel.Topology) -> Any:
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    megatron = MegatronConfig(lr_decay_style="constant", weight_decay=0.0)
    config, model = build(topo)
    ddp = DistributedDataParallel(config=config, ddp_config=megatron_args.ddp_config(megatron), module=model)
    ddp.broadcast_params()
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(megatron_args.optimizer_config(megatron, SFT), [ddp])
    config.grad_scale_func = optimizer.scale_loss
    scheduler = megatron_args.build_scheduler(optimizer, megatron, SFT)
    # What train_step reads of tether's Actor (whose builder takes an HF checkpoint).
    arch = SimpleNamespace(vocab_size=mm.VOCAB)
    return SimpleNamespace(arch=arch, config=config, chunks=[ddp], optimizer=optimizer, scheduler=scheduler)


def forced_targets(
    shard: Any, mb: list[int], router_layer: int, recorded: torch.Tensor | None
) -> torch.Tensor:
    """Megatron's router order ([s, b] flattened s-major) of one micro-batch's experts for one layer:
    from the samples' routed experts, or a recorded entry as it is."""
    if recorded is not None:
        return recorded.long()
    lengths = [int(shard.total_lengths[i]) for i in mb]
    s, b = max(lengths), len(mb)
    target = torch.zeros(s, b, mm.TOPK, dtype=torch.long)
    target[:] = torch.arange(mm.TOPK)  # positions no engine routed: the filler tether uses
    for col, i in enumerate(mb):
        rows = shard.routed_experts[shard.offsets[i] : shard.offsets[i] + lengths[col] - 1, router_layer]
        target[: lengths[col] - 1, col] = torch.from_numpy(rows.astype(np.int64))
    return target.reshape(s * b, mm.TOPK)


def forced_log_probs(
    topo: parallel.Topology,
    weights: dict[str, torch.Tensor],
    shard: Any,
    plan: list[list[int]],
    recorded: Any,
) -> np.ndarray:
    """Log-probs of a reference model with the given weights, each micro-batch forced by Megatron's
    own RouterReplay to the samples' experts (or to `recorded[router][k]`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay as MegatronReplay
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    MegatronReplay.clear_global_router_replay_instances()
    config, ref = build(topo, megatron_replay=True)
    ref.load_state_dict(weights)
    routers = mm.routers(ref)
    out = np.zeros(int(shard.response_lengths.sum()), dtype=np.float32)
    try:
        for k, mb in enumerate(plan):
            for r_index, router in enumerate(routers):
                entry = None if recorded is None else recorded[r_index][k]
                router.router_replay.set_target_indices(
                    forced_targets(shard, mb, router.layer_number - 1, entry)
                )
            MegatronReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            lp, _ = step.compute_log_probs([ref], config, mm.VOCAB, shard, [mb])
            ro = shard.response_offsets
            for i in mb:
                out[ro[i] : ro[i + 1]] = lp[ro[i] : ro[i + 1]]
            MegatronReplay.clear_global_indices()
    finally:
        MegatronReplay.clear_global_router_replay_instances()
    return out


def snapshot(a: Any) -> dict[str, Any]:
    """The actor's weights (and extra states) as they are now."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in unwrap(a.chunks[0]).state_dict().items()}


def step_nll(lp: np.ndarray) -> float:
    """The step's mean NLL over every DP rank's response tokens (what sft_nll reports)."""
    from megatron.core import parallel_state as ps

    parts: list[Any] = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(
        parts,
        (float(-lp.astype(np.float64).sum()), int(lp.size)),
        group=ps.get_data_parallel_group(with_context_parallel=False),
    )
    return sum(p[0] for p in parts) / sum(p[1] for p in parts)


def run(layout: str, pp: int, results: common.Results) -> None:
    topo = reinit(pp)
    batch = build_train_batch(samples(8, seed=11), rewards=[0.0] * 8)
    shards = shard_for_data_parallel(batch, topo.dp_size)
    plan = plan_micro_batches(shards, micro_batch_size=2)[topo.dp_rank]
    shard = shards[topo.dp_rank]

    # --- R3 ---
    a = actor(topo)
    weights = snapshot(a)
    normal, _ = step.compute_log_probs(a.chunks, a.config, mm.VOCAB, shard, plan)
    r3 = RoutingReplay.install(a.chunks, from_rollout=True, flag="--use-rollout-routing-replay")
    replayed, _ = step.compute_log_probs(a.chunks, a.config, mm.VOCAB, shard, plan, routing=r3)
    forced = forced_log_probs(topo, weights, shard, plan, None)
    results.set(f"{layout}/r3/routers", [r.name for r in r3.routers])
    results.set(f"{layout}/r3/max_diff_forced", float(np.abs(replayed - forced).max()))
    results.set(f"{layout}/r3/max_diff_normal", float(np.abs(replayed - normal).max()))
    metrics = step.train_step(a, shard, plan, SFT, routing=r3)
    results.set(f"{layout}/r3/sft_nll", metrics["sft_nll"])
    results.set(f"{layout}/r3/nll_replayed", step_nll(replayed))
    results.set(f"{layout}/r3/nll_normal", step_nll(normal))
    results.set(f"{layout}/r3/left_after_step", r3.has_record)
    results.set(f"{layout}/r3/grad_norm", metrics["grad_norm"])
    r3.uninstall()
    results.set(
        f"{layout}/r3/uninstalled", all(r.router_replay is None for r in mm.routers(unwrap(a.chunks[0])))
    )

    # --- R2 ---
    a = actor(topo)
    r2 = RoutingReplay.install(a.chunks, from_rollout=False, flag="--use-routing-replay")
    step.compute_log_probs(a.chunks, a.config, mm.VOCAB, shard, plan, routing=r2)
    recorded = [[e.clone() for e in r.entries] for r in r2.routers]
    results.set(f"{layout}/r2/recorded", [len(e) for e in recorded])
    with torch.no_grad():
        for router in mm.routers(unwrap(a.chunks[0])):
            router.weight.mul_(-1)  # the router's own top-k now differs from the record
    weights = snapshot(a)
    forced = forced_log_probs(topo, weights, shard, plan, recorded)
    # Normal routing with the changed weights: no pass of the replay is active, so the routers
    # choose on their own (the record stays for the step).
    own, _ = step.compute_log_probs(a.chunks, a.config, mm.VOCAB, shard, plan)
    metrics = step.train_step(a, shard, plan, SFT, routing=r2)
    results.set(f"{layout}/r2/sft_nll", metrics["sft_nll"])
    results.set(f"{layout}/r2/nll_forced_recorded", step_nll(forced))
    results.set(f"{layout}/r2/nll_own", step_nll(own))
    results.set(f"{layout}/r2/left_after_step", r2.has_record)
    # A train step with nothing recorded is refused, naming the cause.
    try:
        step.train_step(a, shard, plan, SFT, routing=r2)
        results.set(f"{layout}/r2/unrecorded_step", "no error")
    except RuntimeError as exc:
        results.set(f"{layout}/r2/unrecorded_step", str(exc))
    r2.uninstall()


def main() -> None:
    work = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", rank)
    mm.cpu_moe_fixes()
    for layout, pp in (("dp2", 1), ("pp2", 2)):
        results.record(f"{layout}/run", lambda lay=layout, p=pp: run(lay, p, results))
        dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

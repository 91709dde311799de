"""torchrun --nproc-per-node 2 check_trainer_state.py WORK_DIR: slime's trainer-state flags on real
Megatron ranks (TP=1, PP=2), each rank driving its own `TrainerWorker` as the head drives it (the
same requests, built by `tether.train.rank.work.rollout_steps`, with the pool's first/last-of-rollout marks).

- ref_update: --use-kl-loss --ref-update-interval 2: the reference's log-probs equal the actor's
  at the start, differ after rollout 0 trained, and equal them again once rollout 1 trained.
- reset: --reset-optimizer-states: Adam's step count and moments over two rollouts of two steps.
- old_actor: --keep-old-actor: the old log-probs come from the old actor's weights, which follow
  the weight updates one behind (--update-weights-interval 1); the actor's own come back exactly.
- freeze / only_train: frozen weights unchanged, the others changed, no optimizer state for them;
  a stage where nothing trains; a list that matches nothing is refused on every rank; a partly
  frozen actor's checkpoint resumes, also when rank 0's stage trains nothing (Megatron keeps Adam's
  step in the checkpoint's rank-0 part, which then has none: tether restores it from its run state).
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
import torch.distributed as dist

from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.rank import step as steps_mod
from tether.train.rank.protocol import InitRequest, LoadRequest, LogProbsRequest, SaveRequest
from tether.train.rank.work import WorkOptions, rollout_steps
from tether.train.rank.worker import TrainerWorker
from tether.train.state.weight_copies import live_tensors

MEGATRON = MegatronConfig(
    pipeline_model_parallel_size=2, weight_decay=0.0, adam_beta2=0.98, lr_decay_style="constant"
)


def groups(seed: int, n: int = 4) -> list[list[Sample]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        response = [int(t) for t in rng.integers(10, 300, 3)]
        out.append(
            Sample(
                index=i,
                group_index=i // 2,
                rollout_id=i,
                tokens=[1, 2, int(rng.integers(10, 300)), *response],
                response_length=3,
                loss_mask=[1, 1, 1],
                rollout_log_probs=[-1.0, -1.0, -1.0],
                reward=float(i % 2),
                status=Sample.Status.COMPLETED,
            )
        )
    return [out[0:2], out[2:4]]


def new_worker(executor: ThreadPoolExecutor) -> TrainerWorker:
    return TrainerWorker(executor)


async def init(worker: TrainerWorker, hf: Path, algorithm: AlgorithmConfig) -> None:
    await worker.init(InitRequest(hf_checkpoint=str(hf), algorithm=algorithm, megatron=MEGATRON))


async def train_rollout(
    worker: TrainerWorker, algorithm: AlgorithmConfig, rollout_id: int, seed: int, gbs: int = 4
) -> list[dict[str, float]]:
    """One rollout as the pool trains it: each step's log-probs, then its train request."""
    work = rollout_steps(groups(seed), algorithm, WorkOptions(global_batch_size=gbs), dp_size=1)
    metrics = []
    for i, st in enumerate(work):
        got = {
            m: [(await worker.compute_log_probs(r)).log_probs for r in st.log_prob_requests(m)]
            for m in st.log_prob_models
        }
        st.with_log_probs(got)
        (request,) = st.train_requests(rollout_id)
        request.first_of_rollout, request.last_of_rollout = i == 0, i == len(work) - 1
        metrics.append((await worker.train(request)).metrics)
    return metrics


def probe() -> tuple[Any, list[list[int]]]:
    """A fixed batch to compare log-probs on."""
    batch = common.make_batch(4, seed=11)
    return batch, [[0, 1], [2, 3]]


async def log_probs(worker: TrainerWorker, model: str) -> np.ndarray:
    batch, plan = probe()
    return (await worker.compute_log_probs(LogProbsRequest(shard=batch, plan=plan, model=model))).log_probs  # type: ignore[arg-type]


async def actor_now(worker: TrainerWorker) -> np.ndarray:
    """The actor's log-probs with its current weights (no old-actor swap)."""
    actor = worker._actor
    batch, plan = probe()

    def run() -> np.ndarray:
        lp, _ = steps_mod.compute_log_probs(
            actor.chunks,
            actor.config,
            actor.arch.vocab_size,
            batch,
            plan,
            steps_mod.StepOptions(with_entropy=False),
        )
        return lp

    return await worker._run(run)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


async def ref_update(executor: ThreadPoolExecutor, hf: Path) -> dict[str, Any]:
    algo = AlgorithmConfig(lr=3e-3, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=2)
    w = new_worker(executor)
    await init(w, hf, algo)
    out = {"start": max_diff(await log_probs(w, "actor"), await log_probs(w, "ref"))}
    await train_rollout(w, algo, 0, seed=1)  # (0 + 1) % 2 != 0: the reference stays
    out["after_rollout0"] = max_diff(await log_probs(w, "actor"), await log_probs(w, "ref"))
    await train_rollout(w, algo, 1, seed=2)  # (1 + 1) % 2 == 0: the reference takes the actor's weights
    out["after_rollout1"] = max_diff(await log_probs(w, "actor"), await log_probs(w, "ref"))
    await train_rollout(w, algo, 2, seed=3)
    out["after_rollout2"] = max_diff(await log_probs(w, "actor"), await log_probs(w, "ref"))
    return out


def adam_state(worker: TrainerWorker) -> dict[str, float]:
    opt = worker._actor.optimizer
    states = [s for o in getattr(opt, "chained_optimizers", [opt]) for s in o.optimizer.state.values()]
    return {
        "params": float(len(states)),
        "step": max(float(s["step"]) for s in states),
        "moments": max(float(s["exp_avg"].abs().max()) + float(s["exp_avg_sq"].abs().max()) for s in states),
    }


async def reset(executor: ThreadPoolExecutor, hf: Path) -> dict[str, Any]:
    from tether.train.state.optimizer_reset import reset_optimizer_states

    out: dict[str, Any] = {}
    for flag in (False, True):
        algo = AlgorithmConfig(lr=3e-3, reset_optimizer_states=flag)
        w = new_worker(executor)
        await init(w, hf, algo)
        # Two rollouts of two steps each (global batch 2 of 4 samples): Adam's step after each step.
        seen = []
        for rollout in range(2):
            work = rollout_steps(groups(rollout), algo, WorkOptions(global_batch_size=2), dp_size=1)
            for i, st in enumerate(work):
                got = {
                    m: [(await w.compute_log_probs(r)).log_probs for r in st.log_prob_requests(m)]
                    for m in st.log_prob_models
                }
                st.with_log_probs(got)
                (request,) = st.train_requests(rollout)
                request.first_of_rollout, request.last_of_rollout = i == 0, i == len(work) - 1
                await w.train(request)
                seen.append(adam_state(w)["step"])
        out[f"steps_reset={flag}"] = seen
        if flag:
            await w._run(lambda w=w: reset_optimizer_states(w._actor.optimizer))
            out["after_reset"] = adam_state(w)
    return out


async def old_actor(executor: ThreadPoolExecutor, hf: Path) -> dict[str, Any]:
    algo = AlgorithmConfig(lr=3e-3, keep_old_actor=True)
    w = new_worker(executor)
    await init(w, hf, algo)
    w0 = await actor_now(w)
    out: dict[str, Any] = {"start": max_diff(await log_probs(w, "actor"), w0)}
    await train_rollout(w, algo, 0, seed=1)  # W1
    w1 = await actor_now(w)
    out["trained_moved"] = max_diff(w1, w0)
    out["old_is_w0"] = max_diff(await log_probs(w, "actor"), w0)
    out["actor_back"] = max_diff(await actor_now(w), w1)  # the swap put W1 back exactly
    await w._run(lambda: w._advance_old_actor(1))  # the engines get W1; old_actor stays W0 (one behind)
    out["after_update1_old_is_w0"] = max_diff(await log_probs(w, "actor"), w0)
    await train_rollout(w, algo, 1, seed=2)  # W2
    await w._run(lambda: w._advance_old_actor(1))  # old_actor <- W1
    out["after_update2_old_is_w1"] = max_diff(await log_probs(w, "actor"), w1)
    await w._run(lambda: w._advance_old_actor(2))  # another interval: old_actor <- the actor (W2)
    out["interval2_old_is_actor"] = max_diff(await log_probs(w, "actor"), await actor_now(w))
    return out


def weights_of(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in live_tensors(worker._actor.chunks).items()}


async def freeze(
    executor: ThreadPoolExecutor, hf: Path, ckpt: Path | None, **lists: list[str]
) -> dict[str, Any]:
    algo = AlgorithmConfig(lr=3e-3, **lists)  # type: ignore[arg-type]
    w = new_worker(executor)
    await init(w, hf, algo)
    before = weights_of(w)
    await train_rollout(w, algo, 0, seed=1)
    after = weights_of(w)
    if ckpt is None:
        return _freeze_result(w, before, after)
    # A checkpoint of a partly frozen actor saves, and a fresh actor with the same lists resumes
    # from it (weights and the trainable parameters' optimizer state), then trains on.
    await w.save(SaveRequest(save_dir=str(ckpt), step=0, rollout_id=0))
    resumed = new_worker(executor)
    await init(resumed, hf, algo)
    state = await resumed.load(LoadRequest(load_dir=str(ckpt)))
    assert state is not None and state.rollout_id == 0, state
    reloaded = weights_of(resumed)
    assert all(torch.equal(reloaded[n], after[n]) for n in after), "the resumed weights differ"
    await train_rollout(resumed, algo, 1, seed=2)
    return _freeze_result(w, before, after)


def _freeze_result(
    w: TrainerWorker, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> dict[str, Any]:
    grads = {n: p.requires_grad for n, p in w._actor.chunks[0].module.named_parameters()}
    opt = w._actor.optimizer
    in_optimizer = sum(
        len(g["params"]) for o in getattr(opt, "chained_optimizers", [opt]) for g in o.optimizer.param_groups
    )
    return {
        "changed": sorted(n.split(".", 1)[1] for n in before if not torch.equal(before[n], after[n])),
        "trainable": sorted(n for n, g in grads.items() if g),
        "frozen": sorted(n for n, g in grads.items() if not g),
        "in_optimizer": in_optimizer,
    }


async def refused(executor: ThreadPoolExecutor, hf: Path) -> dict[str, Any]:
    algo = AlgorithmConfig(freeze_params_name_list=["no_such_module"])
    try:
        await init(new_worker(executor), hf, algo)
    except ConfigError as exc:
        return {"key": exc.key, "value": exc.value, "message": str(exc)}
    return {"key": None}


async def run_all(hf: Path, results: common.Results) -> None:
    ckpt = hf.parents[1] / "checkpoints"
    with ThreadPoolExecutor(max_workers=1) as executor:
        for name, fn in (
            ("ref_update", lambda: ref_update(executor, hf)),
            ("reset", lambda: reset(executor, hf)),
            ("old_actor", lambda: old_actor(executor, hf)),
            (
                "freeze",
                lambda: freeze(
                    executor, hf, ckpt / "freeze", freeze_params_name_list=["embedding", "linear_fc1"]
                ),
            ),
            (
                "only_train",
                lambda: freeze(
                    executor, hf, ckpt / "only_train", only_train_params_name_list=["output_layer"]
                ),
            ),
            ("refused", lambda: refused(executor, hf)),
        ):
            try:
                results.set(name, await fn())
            except Exception:
                import traceback

                results.data[name] = {"ok": False, "error": traceback.format_exc()}
                results.flush()
                print(f"[rank {results.rank}] {name} FAILED\n{traceback.format_exc()}", flush=True)
                raise


def main() -> None:
    work = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", rank)
    if rank == 0:
        common.make_models(work / "models", families={"llama": {"arch": "llama"}})
    from tether.train.parallel import topology as parallel

    parallel.init_distributed(1, 2, seed=1234)
    dist.barrier()
    hf = common.make_models(work / "models", families={"llama": {"arch": "llama"}})["llama"]
    asyncio.run(run_all(hf, results))
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

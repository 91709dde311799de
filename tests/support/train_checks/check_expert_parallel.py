"""torchrun --nproc-per-node 2 check_expert_parallel.py WORK_DIR: a tiny Qwen3-MoE at EP=1 (DP=2),
at EP=2 with Megatron's alltoall token dispatcher, and with experts at ETP=1 under TP=2, on whatever backend the ranks start with
(NCCL on GPUs: tests/gpu/test_expert_parallel_nccl.py; gloo on CPU). For each layout: the logits of
a fixed batch (moved to the host) and two SFT steps' loss and grad norm. Results go to
WORK_DIR/results/rank{N}.json. The same build, dispatch and export code runs over gloo in
check_model.py's ep2 layout (tests/integration/test_train_model.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import check_model
import common
import torch
import torch.distributed as dist

from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.parallel import topology as parallel
from tether.train.rank import step

# layout -> (TP, EP, ETP) (PP=1): DP=2 at EP=1, each rank holding every expert; EP=2; and slime's MoE
# layout, experts at ETP=1 under TP=2 (sequence parallel), whole on both TP ranks or split by EP=2.
LAYOUTS: dict[str, tuple[int, int, int | None]] = {
    "ep1": (1, 1, None),
    "ep2": (1, 2, None),
    "tp2etp1": (2, 1, 1),
    "tp2ep2etp1": (2, 2, 1),
}
FAMILY = "qwen3_moe"


def logits(actor: model.Actor) -> list[list[float]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, actor.arch.vocab_size, (2, 12), generator=g)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    for c in actor.chunks:
        c.eval()
    got = step.forward_logits(
        actor.chunks, actor.config, [step.MicroBatch(tokens, pos)], actor.arch.vocab_size
    )
    return got[0].float().cpu().tolist()


def main() -> None:
    work = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    results = common.Results(work / "results", rank)
    (work / "results").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        check_model.make_models(work / "models", [FAMILY])
    for layout, (tp, ep, etp) in LAYOUTS.items():
        topo = check_model.reinit(tp, 1, ep, etp=etp)
        dist.barrier()
        hf_dir = check_model.make_models(work / "models", [FAMILY])[FAMILY]
        opts = model.ModelOptions(
            hf_checkpoint=str(hf_dir),
            algorithm=AlgorithmConfig(lr=1e-3),
            megatron=MegatronConfig(
                weight_decay=0.0,
                adam_beta2=0.98,
                lr_decay_style="constant",
                tensor_model_parallel_size=tp,
                sequence_parallel=tp > 1,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp,
                moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
            ),
        )
        actor = model.build_actor(opts, topo)
        results.set(f"{layout}/backend", dist.get_backend())
        results.record(f"{layout}/logits", lambda a=actor: logits(a))
        for c in actor.chunks:
            c.train()
        results.record(f"{layout}/train", lambda a=actor, t=topo: check_model.train_steps(a, t))
        dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

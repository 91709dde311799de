"""torchrun --nproc-per-node 1 check_offload.py WORK_DIR (needs CUDA): --offload-train's memory move.

Two actors of a tiny Llama train the same three SFT steps; one is offloaded to host RAM and
brought back between every step (what a colocated run does while its engines generate), with a
reference model offloaded alongside. Recorded: device memory before, during and after each
offload, and both actors' losses and final weights.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import common
import torch

from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.parallel import topology as parallel
from tether.train.rank import step
from tether.train.state import offload

SFT = AlgorithmConfig(loss_type="sft_loss", lr=3e-3)


def train(hf: Path, topo: parallel.Topology, megatron: MegatronConfig, offloaded: bool) -> dict[str, Any]:
    gc.collect()  # the previous variant's models are gone before this one measures memory
    torch.cuda.empty_cache()
    opts = model.ModelOptions(hf_checkpoint=str(hf), algorithm=SFT, megatron=megatron)
    actor = model.build_actor(opts, topo)
    reference = model.build_reference(opts, topo)
    params = sum(p.numel() * p.element_size() for p in actor.chunks[0].parameters())
    out: dict[str, Any] = {"loss": [], "memory": [], "param_bytes": params}
    for k in range(3):
        batch = common.make_batch(8, seed=20 + k)
        shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
        out["loss"].append(step.train_step(actor, shard, plan, SFT)["loss"])
        if offloaded:
            before = torch.cuda.memory_allocated()
            state = offload.offload_trainer(actor, reference)
            during = torch.cuda.memory_allocated()
            moved = state.nbytes
            offload.onload_trainer(state)
            after = torch.cuda.memory_allocated()
            out["memory"].append({"before": before, "during": during, "after": after, "moved": moved})
    out["digest"] = common.params_digest(actor.chunks, actor.arch)
    out["reference_digest"] = common.params_digest(reference.chunks, reference.arch)
    return out


def main() -> None:
    work = Path(sys.argv[1])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", int(os.environ["RANK"]))
    hf = common.make_models(work / "models")["llama"]
    topo = parallel.init_distributed(1, 1, seed=1234)
    for precision in ("fp32", "bf16"):
        for distopt in (False, True):
            megatron = MegatronConfig(
                lr_decay_style="constant", bf16=precision == "bf16", use_distributed_optimizer=distopt
            )
            for mode in ("resident", "offloaded"):
                name = f"{precision}/{'distopt' if distopt else 'plain'}/{mode}"
                results.record(name, lambda m=megatron, o=mode == "offloaded": train(hf, topo, m, o))
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

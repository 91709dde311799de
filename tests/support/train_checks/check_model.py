"""torchrun --nproc-per-node 2 check_model.py WORK_DIR: model build, HF conversion, logits parity.

For each layout (DP=2, TP=2, PP=2) and family (Llama, Qwen2 with qkv bias, Qwen3 with qk-norm
and tied embeddings): build the actor from HF, export back to HF names (bit-exact check on
every tensor), compare logits with transformers, and at PP=2 write an HF directory with
save_hf and compare it with the source. Results go to WORK_DIR/results/rank{N}.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import common
import torch
import torch.distributed as dist

from tether.train import export, model, parallel, step
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.hf_convert import HFWeights

LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def reinit(tp: int, pp: int) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return parallel.init_distributed(tp, pp, seed=1234)


def round_trip(actor: model.Actor, hf_dir: Path, topo: parallel.Topology) -> dict[str, object]:
    source = HFWeights(hf_dir)
    names: list[str] = []
    mismatched: list[str] = []
    for name, tensor in export.iter_hf_weights(actor.chunks, actor.arch):
        names.append(name)
        ref = source.get(name)
        if ref.dtype != tensor.dtype or ref.shape != tensor.shape or not torch.equal(ref, tensor):
            mismatched.append(name)
    stage_names: list[list[str] | None] = [None] * topo.world_size
    dist.all_gather_object(stage_names, names)
    covered = sorted({n for ns in stage_names for n in (ns or [])})
    expected = sorted(
        n for n in source.names() if not (actor.arch.tie_word_embeddings and n == "lm_head.weight")
    )
    return {"mismatched": mismatched, "missing": sorted(set(expected) - set(covered)), "count": len(names)}


def logits_parity(actor: model.Actor, hf_dir: Path, topo: parallel.Topology) -> float | None:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, actor.arch.vocab_size, (2, 12), generator=g)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    for c in actor.chunks:
        c.eval()
    got = step.forward_logits(
        actor.chunks, actor.config, [step.MicroBatch(tokens, pos)], actor.arch.vocab_size
    )
    if not topo.is_last_stage:
        return None
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(tokens).logits
    return float((got[0] - want).abs().max())


def save_hf_check(
    actor: model.Actor, hf_dir: Path, out: Path, topo: parallel.Topology
) -> dict[str, object] | None:
    export.save_hf(actor.chunks, actor.arch, topo, out, base_dir=hf_dir, version=3)
    if topo.rank != 0:
        return None
    src, dst = HFWeights(hf_dir), HFWeights(out)
    expected = [n for n in src.names() if not (actor.arch.tie_word_embeddings and n == "lm_head.weight")]
    diff = [n for n in expected if not torch.equal(src.get(n), dst.get(n))]
    return {
        "diff": diff,
        "names_equal": sorted(expected) == dst.names(),
        "config": (out / "config.json").exists(),
    }


def main() -> None:
    work = Path(sys.argv[1])
    import os

    rank = int(os.environ["RANK"])
    results = common.Results(work / "results", rank)
    (work / "results").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        common.make_models(work / "models")
    topo = None
    for layout, (tp, pp) in LAYOUTS.items():
        topo = reinit(tp, pp)
        dist.barrier()
        models = common.make_models(work / "models")
        for family, hf_dir in models.items():
            opts = model.ModelOptions(
                hf_checkpoint=str(hf_dir),
                algorithm=AlgorithmConfig(lr=1e-3),
                megatron=MegatronConfig(weight_decay=0.0, adam_beta2=0.98, lr_decay_style="constant"),
            )
            actor = model.build_actor(opts, topo)
            results.record(
                f"{layout}/{family}/round_trip", lambda a=actor, h=hf_dir, t=topo: round_trip(a, h, t)
            )
            results.record(
                f"{layout}/{family}/logits", lambda a=actor, h=hf_dir, t=topo: logits_parity(a, h, t)
            )
            if layout == "pp2" or (layout == "tp2" and family == "qwen3_tied"):
                out = work / "export" / f"{layout}-{family}"
                results.record(
                    f"{layout}/{family}/save_hf",
                    lambda a=actor, h=hf_dir, o=out, t=topo: save_hf_check(a, h, o, t),
                )
            dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

"""torchrun --nproc-per-node 2 check_model.py WORK_DIR [FAMILY ...]: model build, HF conversion
through mbridge, logits parity.

For each layout (DP=2, TP=2, PP=2; EP=2 for the MoE families) and family (`FAMILIES`: dense Llama, Qwen2 with qkv bias, Qwen3
with qk-norm, tied and untied, GLM-4 with sandwich norms, fused gate_up_proj and interleaved partial
RoPE; MoE Qwen2-MoE, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2; DeepSeek-V3 with MLA + MoE, and its kin
GLM-4.7-Flash and Kimi-K2; Qwen3-Next with gated-DeltaNet linear attention, transformers' own tiny
model): build the actor from HF, export back to HF names (bit-exact check on every tensor), compare
logits with transformers, and at PP=2 write an HF directory with save_hf and compare it with the
source. Results go to WORK_DIR/results/rank{N}.json.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import common
import msgspec
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for support.*

from tether.train.checkpoint import export
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.model.hf_convert import EXPERT_NAME, HFWeights, fused_name
from tether.train.parallel import topology as parallel
from tether.train.rank import step

# layout -> (TP, PP, EP, CP); EP=2 (MoE families only) dispatches tokens with Megatron's alltoall,
# and "ep2ag" with its allgather dispatcher (the families in ALLGATHER_EP only; every rank's
# micro-batches padded to the same shape); CP=2 (context parallelism) runs CONTEXT_PARALLEL only.
LAYOUTS = {
    "dp2": (1, 1, 1, 1),
    "tp2": (2, 1, 1, 1),
    "pp2": (1, 2, 1, 1),
    "ep2": (1, 1, 2, 1),
    "ep2ag": (1, 1, 2, 1),
    "cp2": (1, 1, 1, 2),
    # slime's --allgather-cp: each CP rank a contiguous share (the sparse-attention families only).
    "cp2ag": (1, 1, 1, 2),
    # Experts narrower in TP than the dense layers (ETP=1 under TP=2, slime's MoE layout): whole on
    # both TP ranks (EP=1, their gradients summed over the expert data-parallel group), or split
    # over them by EP=2; the ETP_FAMILIES only.
    "tp2etp1": (2, 1, 1, 1),
    "tp2ep2etp1": (2, 1, 2, 1),
}
EXPERT_TP = {"tp2etp1": 1, "tp2ep2etp1": 1}  # layout -> --expert-tensor-parallel-size
ETP_FAMILIES = ("qwen3_moe", "deepseek_v3")
# A 4-rank launch (`torchrun --nproc-per-node 4`) checks these instead: TP=2 with sequence
# parallelism and CP=2 together (every family's activations split over the TP ranks' sequence
# shards inside each CP rank's load-balanced chunks), against DP=4.
LAYOUTS_4 = {
    "dp4": (1, 1, 1, 1),
    "tp2cp2": (2, 1, 1, 2),
}
ALLGATHER_EP = ("qwen3_moe",)
ALLGATHER_CP = ("glm_moe_dsa",)
# Dense attention, MLA + MoE, and a trained MTP layer (its labels rolled across the CP ranks).
CONTEXT_PARALLEL = ("qwen3", "deepseek_v3", "mimo_mtp", "qwen3_5", "glm_moe_dsa")  # and DeltaNet, DSA
MOE_ARCHES = (
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "deepseek_v3",
    "minimax_m2",
    "glm4_moe_lite",
    "kimi_k2",
    "qwen3_next",
    "qwen3_5_moe",
    "glm_moe_dsa",
    "deepseek_v32",
)
# Family name -> TinyModelSpec fields (tether init-model's families).
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "qwen3_tied": {"arch": "qwen3", "tie_embeddings": True},
    "glm4": {"arch": "glm4"},
    "qwen2_moe": {"arch": "qwen2_moe"},
    "qwen3_moe": {"arch": "qwen3_moe"},
    "mixtral": {"arch": "mixtral"},
    "glm4_moe": {"arch": "glm4_moe"},
    "deepseek_v3": {"arch": "deepseek_v3"},
    "deepseek_v3_yarn": {"arch": "deepseek_v3"},
    # Checkpoints with multi-token-prediction layers, built without them (no --mtp-num-layers):
    # MiMo (Qwen2 + model.mtp_layers) and DeepSeek-V3's layer after the decoder's.
    "mimo": {"arch": "mimo"},
    "deepseek_v3_mtp": {"arch": "deepseek_v3", "mtp_layers": 1},
    # The same checkpoints built with their MTP layers (--mtp-num-layers 1): MiMo trained with
    # --enable-mtp-training and without it (frozen MTP layers), DeepSeek-V3's converted only.
    "mimo_mtp": {"arch": "mimo"},
    "mimo_mtp_frozen": {"arch": "mimo"},
    "deepseek_v3_mtp_built": {"arch": "deepseek_v3", "mtp_layers": 1},
    "glm4_moe_mtp_built": {"arch": "glm4_moe", "mtp_layers": 1},
    # New families go last: a model's seed is its index here (common.make_models), and the
    # MTP families' CP=2 checks compare numbers that are only close.
    "minimax_m2": {"arch": "minimax_m2"},
    # DeepSeek-V3's decoder as GLM-4.7-Flash (mlp_layer_types, values wider than the query's nope
    # part, one expert group) and as Kimi-K2 (its config.json's model_type and YaRN, CONFIG_CHANGES);
    # GLM-4.7-Flash also with its MTP layer built (slime trains it).
    "glm4_moe_lite": {"arch": "glm4_moe_lite"},
    "kimi_k2": {"arch": "kimi_k2"},
    "glm4_moe_lite_mtp_built": {"arch": "glm4_moe_lite", "mtp_layers": 1},
    # Qwen3-Next: gated-DeltaNet linear attention and gated full attention, zero-centred norms; its
    # tiny model is transformers' own (common.HF_WRITTEN).
    "qwen3_next": {"arch": "qwen3_next"},
    # Qwen3.5 as published: a vision-language checkpoint (decoder under text_config and
    # model.language_model., a vision tower and an MTP module the trainer keeps aside), linear
    # attention's projections apart; dense, and MoE with its experts stored fused.
    "qwen3_5": {"arch": "qwen3_5"},
    "qwen3_5_moe": {"arch": "qwen3_5_moe"},
    # DeepSeek sparse attention: MLA whose keys an indexer chooses (index_topk 4 of a dozen tokens);
    # GLM-5 with interleaved indexer RoPE and every other layer sharing the previous one's choice
    # (four layers: full, shared, full, shared), DeepSeek-V3.2 with half-split indexer RoPE.
    "glm_moe_dsa": {"arch": "glm_moe_dsa", "layers": 4},
    "deepseek_v32": {"arch": "deepseek_v32"},
}
# The sparse-attention families train as slime's GLM-5 recipe does, without the expert-bias update
# (--moe-router-bias-update-rate 0): that update counts padding tokens too, which layouts that
# batch the samples differently (DP=2 vs CP=2) pad differently.
DSA_FLAGS: dict[str, object] = {"moe_router_bias_update_rate": 0.0}
# Families built with MTP layers: their MegatronConfig flags.
MTP_FLAGS: dict[str, dict[str, object]] = {
    "mimo_mtp": {"mtp_num_layers": 1, "enable_mtp_training": True},
    "mimo_mtp_frozen": {"mtp_num_layers": 1},
    "deepseek_v3_mtp_built": {"mtp_num_layers": 1},
    "glm4_moe_mtp_built": {"mtp_num_layers": 1},
    "glm4_moe_lite_mtp_built": {"mtp_num_layers": 1},
}
# DeepSeek-V3's MTP layer carries its own copies of the embedding and the output head in HF;
# Megatron's MTP block uses the model's (as slime converts it), so those two are not built.
_SHARED_MTP_COPY = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")
# HF tensors of MTP layers: without --mtp-num-layers they are not built, so (as in slime) they are
# neither loaded nor exported.
_MTP_NAME = re.compile(r"^model\.(mtp_layers\.\d+\.|layers\.(\d+)\.)")


def is_mtp_name(name: str, num_layers: int) -> bool:
    m = _MTP_NAME.match(name)
    return m is not None and (m.group(2) is None or int(m.group(2)) >= num_layers)


def not_built(name: str, arch_layers: int, mtp_built: bool) -> bool:
    """An HF tensor the Megatron model does not hold: MTP layers not built, or (built) the MTP
    layer's copies of the embedding and head."""
    if not is_mtp_name(name, arch_layers):
        return False
    return not mtp_built or _SHARED_MTP_COPY.match(name) is not None


# config.json changes after writing: DeepSeek's YaRN RoPE (mbridge 0.15.1 reads it only from
# `rope_scaling`; transformers 5 keeps it in `rope_parameters`), and Kimi-K2's as its config.json
# writes it (`rope_scaling` with `type`, rope_theta beside it, beta_fast = beta_slow = 1).
CONFIG_CHANGES: dict[str, dict[str, object]] = {
    "deepseek_v3_yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    },
    "kimi_k2": {
        "rope_parameters": None,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


# Families also trained for two SFT steps per layout: loss and grad norm at TP=2 (with sequence
# parallelism) and PP=2 must equal DP=2's (experts' TP shards counted once, MLA's shared RoPE key
# summed over TP, GLM-4's sequence-parallel output norms' gradients summed over TP).
TRAINED = (
    "qwen3_moe",
    "deepseek_v3",
    "glm4",
    "mimo_mtp",
    "mimo_mtp_frozen",
    "qwen3",
    "minimax_m2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "glm_moe_dsa",
)
# Families built with --sequence-parallel at TP=2: MoE (Megatron requires it) and GLM-4 (slime's
# GLM-4-9B script runs with it).
SEQUENCE_PARALLEL = ("glm4", "qwen3_5")  # Qwen3.5's linear attention needs it at TP > 1
SFT = AlgorithmConfig(loss_type="sft_loss", lr=1e-3)


def _weights(actor: model.Actor, mtp_part: bool) -> dict[str, torch.Tensor]:
    """This rank's MTP weights (`mtp_part`) or the others, copied."""
    from tether.train.model.mtp import is_mtp_param

    return {
        n: p.detach().clone()
        for n, p in model.unwrap(actor.chunks[0]).named_parameters()
        if is_mtp_param(n) == mtp_part
    }


def _changed(before: dict[str, torch.Tensor], actor: model.Actor, mtp_part: bool) -> list[str]:
    after = _weights(actor, mtp_part)
    return sorted(n for n in before if not torch.equal(before[n], after[n]))


def train_steps(actor: model.Actor, topo: parallel.Topology) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for k in range(2):
        batch = common.make_batch(8, seed=20 + k)
        shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
        mtp_before, rest_before = _weights(actor, True), _weights(actor, False)
        m = step.train_step(actor, shard, plan, SFT)
        got: dict[str, object] = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
        if "mtp_loss" in m:
            got.update(mtp_loss=float(m["mtp_loss"]), mtp_1_loss=float(m["mtp_1_loss"]))
        if mtp_before:  # this rank holds MTP layers: which weights the step changed
            got.update(
                mtp_changed=_changed(mtp_before, actor, True),
                mtp_count=len(mtp_before),
                others_changed=len(_changed(rest_before, actor, False)),
            )
        out.append(got)
    return out


def indexer_steps(opts: model.ModelOptions, topo: parallel.Topology) -> dict[str, int]:
    """--freeze-indexer: with weight decay on, one SFT step changes the indexer's weights (decay is
    all it gets: it has no gradient path), and with the flag it changes none of them."""
    from tether.train.model.families.dsa import is_indexer_parameter

    changed = {}
    for frozen in (False, True):
        actor = model.build_actor(
            dataclasses.replace(
                opts,
                algorithm=msgspec.structs.replace(SFT, freeze_indexer=frozen),
                megatron=msgspec.structs.replace(opts.megatron, weight_decay=0.1),
            ),
            topo,
        )
        before = {n: p.detach().clone() for n, p in model.unwrap(actor.chunks[0]).named_parameters()}
        batch = common.make_batch(8, seed=20)
        shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
        step.train_step(actor, shard, plan, SFT)
        after = dict(model.unwrap(actor.chunks[0]).named_parameters())
        names = [n for n in before if is_indexer_parameter(n)]
        key = "frozen" if frozen else "trained"
        changed[key] = sum(not torch.equal(before[n], after[n].detach()) for n in names)
        changed[f"{key}_others"] = sum(
            not torch.equal(before[n], after[n].detach()) for n in before if n not in names
        )
        changed["indexer_params"] = len(names)
    return changed


def mtp_logits_unchanged(
    actor: model.Actor, opts: model.ModelOptions, topo: parallel.Topology
) -> float | None:
    """Max difference between the actor's logits and those of the same checkpoint built without MTP
    layers (None off the last stage)."""
    import msgspec

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, actor.arch.vocab_size, (2, 12), generator=g)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    megatron = msgspec.structs.replace(opts.megatron, mtp_num_layers=None, enable_mtp_training=False)
    plain = model.build_reference(
        model.ModelOptions(hf_checkpoint=opts.hf_checkpoint, megatron=megatron), topo
    )
    for c in actor.chunks:
        c.eval()
    mb = [step.MicroBatch(tokens, pos)]
    got = step.forward_logits(actor.chunks, actor.config, mb, actor.arch.vocab_size)
    want = step.forward_logits(plain.chunks, plain.config, mb, plain.arch.vocab_size)
    if not topo.is_last_stage:
        return None
    return float((got[0] - want[0]).abs().max())


def make_models(root: Path, families: list[str]) -> dict[str, Path]:
    """The families' tiny models under root (common.make_models, with the config changes above)."""
    chosen = {name: FAMILIES[name] for name in families}
    return common.make_models(root, families=chosen, config_changes=CONFIG_CHANGES)


def reinit(
    tp: int, pp: int, ep: int, cp: int = 1, etp: int | None = None, contiguous_cp: bool = False
) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return parallel.init_distributed(
        tp,
        pp,
        seed=1234,
        expert_parallel=ep,
        context_parallel=cp,
        expert_tensor_parallel=etp,
        contiguous_context=contiguous_cp,
    )


def round_trip(actor: model.Actor, hf_dir: Path, topo: parallel.Topology) -> dict[str, object]:
    """Every exported tensor equals the source's; every source tensor the model holds is exported (a
    fused expert tensor by its experts' names; those the trainer keeps aside are not held)."""
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
    covered = sorted({in_source(source, n) for ns in stage_names for n in (ns or [])})
    expected = sorted(
        n
        for n in source.names()
        if not (actor.arch.tie_word_embeddings and n == "lm_head.weight")
        and not not_built(n, actor.arch.num_layers, bool(actor.config.mtp_num_layers))
        and not n.startswith(actor.arch.hf_kept_prefixes)
    )
    return {"mismatched": mismatched, "missing": sorted(set(expected) - set(covered)), "count": len(names)}


def in_source(source: HFWeights, name: str) -> str:
    """The source tensor holding exported tensor `name` (itself, or the fused experts' tensor)."""
    expert = EXPERT_NAME.match(name)
    return fused_name(expert) if expert is not None and name not in source.weight_map else name


def logits_parity(actor: model.Actor, hf_dir: Path, topo: parallel.Topology) -> float | None:
    from support.hf_reference import load_causal_lm  # MiMo's reference is Qwen2 (no transformers class)

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
    hf = load_causal_lm(hf_dir)
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
    expected = [
        n
        for n in src.names()
        if not (actor.arch.tie_word_embeddings and n == "lm_head.weight")
        and not not_built(n, actor.arch.num_layers, bool(actor.config.mtp_num_layers))
    ]
    diff = [n for n in expected if not torch.equal(src.get(n), dst.get(n))]
    return {
        "diff": diff,
        "names_equal": sorted(expected) == dst.names(),
        # The source's config.json, as it was (Kimi-K2's model_type kimi_k2 included).
        "config": (out / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes(),
    }


def main() -> None:
    work = Path(sys.argv[1])
    families = sys.argv[2:] or list(FAMILIES)
    import os

    rank = int(os.environ["RANK"])
    results = common.Results(work / "results", rank)
    (work / "results").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        make_models(work / "models", families)
    topo = None
    layouts = LAYOUTS_4 if int(os.environ["WORLD_SIZE"]) == 4 else LAYOUTS
    for layout, (tp, pp, ep, cp) in layouts.items():
        etp = EXPERT_TP.get(layout)
        topo = reinit(tp, pp, ep, cp, etp, contiguous_cp=layout == "cp2ag")
        dist.barrier()
        models = make_models(work / "models", families)
        for family, hf_dir in models.items():
            # Megatron runs MoE layers at TP > 1 with sequence parallelism (the local norms accept it).
            moe = FAMILIES[family]["arch"] in MOE_ARCHES
            sequence_parallel = (moe or family in SEQUENCE_PARALLEL or cp > 1) and tp > 1
            if (
                (ep > 1 and not moe)
                or (cp > 1 and family not in CONTEXT_PARALLEL)
                or (layout == "ep2ag" and family not in ALLGATHER_EP)
                or (layout == "cp2ag" and family not in ALLGATHER_CP)
                or (etp is not None and family not in ETP_FAMILIES)
            ):
                continue
            opts = model.ModelOptions(
                hf_checkpoint=str(hf_dir),
                algorithm=AlgorithmConfig(lr=1e-3),
                megatron=MegatronConfig(
                    weight_decay=0.0,
                    adam_beta2=0.98,
                    lr_decay_style="constant",
                    tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp,
                    sequence_parallel=sequence_parallel,
                    expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=etp,
                    context_parallel_size=cp,
                    allgather_cp=layout == "cp2ag",
                    moe_token_dispatcher_type="alltoall" if layout == "ep2" else "allgather",
                    **MTP_FLAGS.get(family, {}),  # type: ignore[arg-type]
                    **(DSA_FLAGS if family in ALLGATHER_CP or family == "deepseek_v32" else {}),  # type: ignore[arg-type]
                ),
            )
            actor = model.build_actor(opts, topo)
            results.record(
                f"{layout}/{family}/layout",
                lambda a=actor, t=topo: {
                    "tp": t.tp_size,
                    "cp": t.cp_size,
                    "dp": t.dp_size,
                    "sequence_parallel": bool(a.config.sequence_parallel),
                    "etp": int(a.config.expert_tensor_parallel_size or t.tp_size),
                },
            )
            if family in MTP_FLAGS:
                results.record(
                    f"{layout}/{family}/mtp_logits",
                    lambda a=actor, o=opts, t=topo: mtp_logits_unchanged(a, o, t),
                )
            results.record(
                f"{layout}/{family}/round_trip", lambda a=actor, h=hf_dir, t=topo: round_trip(a, h, t)
            )
            results.record(
                f"{layout}/{family}/logits", lambda a=actor, h=hf_dir, t=topo: logits_parity(a, h, t)
            )
            if layout in ("pp2", "ep2", "tp2ep2etp1") or (layout == "tp2" and family == "qwen3_tied"):
                out = work / "export" / f"{layout}-{family}"
                results.record(
                    f"{layout}/{family}/save_hf",
                    lambda a=actor, h=hf_dir, o=out, t=topo: save_hf_check(a, h, o, t),
                )
            if family in TRAINED:
                for c in actor.chunks:
                    c.train()
                results.record(f"{layout}/{family}/train", lambda a=actor, t=topo: train_steps(a, t))
            if layout == "dp2" and family == "glm_moe_dsa":
                results.record(
                    f"{layout}/{family}/freeze_indexer", lambda o=opts, t=topo: indexer_steps(o, t)
                )
            dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

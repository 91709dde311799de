"""torchrun --nproc-per-node 2 check_megatron_ckpt.py WORK_DIR: Megatron-LM's checkpoint layout.

1. "foreign": at TP=2, a model with weights moved off its HF source is saved by bare Megatron
   calls (GPTModel.sharded_state_dict + the distributed optimizer's + dist_checkpointing.save,
   Megatron-LM's layout: tracker "7", iter_0000007/) and exported to HF. tether's --ref-load
   (`load_weights_only`) reads it at TP=1 (DP=2) and at PP=2: the weights equal the export's,
   and the log-probs equal a model built from the exported HF weights (bit for bit) and the
   TP=2 model's (float tolerance); so does the on-policy distillation teacher loaded from it by
   --opd-teacher-load / --opd-teacher-ckpt-step 7 (`tether.train.algorithms.opd_teacher`). A resume (`load_checkpoint`) of it at TP=1 is refused,
   naming both layouts; at TP=2 it resumes after iteration 7, optimizer included.
2. "tether_save": at DP=2 a trained actor is saved by `checkpoint.save`; a fresh GPTModel built
   with bare Megatron calls loads it through dist_checkpointing alone (no tether code) with
   equal weights, and its common state says what Megatron-LM's load reads.
3. "resume": a fresh actor resumes that checkpoint: run state, weights, Adam state and each
   rank's RNG stream as saved; tether's previous layout (model_optim/, `latest`) still resumes.
4. "te_names": checkpoints written under TransformerEngine names (TE `_extra_state` objects in
   place of the local ones) and under the older local names (input_layernorm, pre_mlp_layernorm)
   load into the CPU model with equal weights.
5. "flags": Megatron's checkpoint flags. --no-save-optim writes no optimizer state and a resume
   from it starts a fresh optimizer; --no-load-optim / --no-load-rng leave optimizer / RNG fresh;
   --ckpt-step loads the iteration it names, not the tracker's; --async-save returns before the
   files are written (a gate holds the writer while a train step runs), the previous checkpoint
   stays the resume point until `finalize`, after which the new one is complete, named by the
   tracker, and holds the weights of its step boundary.
Results go to WORK_DIR/results/rank{N}.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
from pathlib import Path
from typing import Any

import common
import msgspec
import torch
import torch.distributed as dist

from tether.train.checkpoint import export
from tether.train.checkpoint import load_save as checkpoint
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model import build as model
from tether.train.parallel import topology as parallel
from tether.train.rank import step

SFT = AlgorithmConfig(loss_type="sft_loss")
FAMILY = "qwen2"  # qkv bias, untied embeddings
MOE_FAMILY = "qwen3_moe"


def options(hf_dir: Path) -> model.ModelOptions:
    return model.ModelOptions(
        hf_checkpoint=str(hf_dir),
        algorithm=AlgorithmConfig(lr=3e-3),
        megatron=MegatronConfig(
            weight_decay=0.0, adam_beta2=0.98, lr_decay_style="constant", use_distributed_optimizer=True
        ),
    )


def reinit(tp: int, pp: int, etp: int | None = None) -> parallel.Topology:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    topo = parallel.init_distributed(tp, pp, seed=1234, expert_tensor_parallel=etp)
    dist.barrier()
    return topo


def log_probs(chunks: list[Any], config: Any, vocab: int) -> list[float]:
    batch = common.make_batch(4, seed=9)
    for c in chunks:
        c.eval()
    lp, _ = step.compute_log_probs(chunks, config, vocab, batch, [[0, 1], [2, 3]])
    return [float(x) for x in lp]


def hf_tensors(chunks: list[Any], arch: Any) -> dict[str, torch.Tensor]:
    """Every full HF-named weight of the model, gathered on every rank."""
    mine = {name: t.clone() for name, t in export.iter_hf_weights(chunks, arch)}
    every: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: dict[str, torch.Tensor] = {}
    for part in every:
        out.update(part or {})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (or that only one side has)."""
    return sorted(n for n in {*a, *b} if n not in a or n not in b or not torch.equal(a[n], b[n]))


def bare_megatron_save(actor: model.Actor, root: Path, iteration: int) -> None:
    """What Megatron-LM's save_checkpoint writes, with megatron.core calls only (no tether code)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    meta = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}
    gpt = model.unwrap(actor.chunks[0])
    model_sd = gpt.sharded_state_dict(metadata=meta)
    state = {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, metadata=meta),
        "opt_param_scheduler": actor.scheduler.state_dict(),
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "args": argparse.Namespace(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            num_layers=actor.config.num_layers,
            hidden_size=actor.config.hidden_size,
        ),
    }
    target = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(target), content_metadata=meta)
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def foreign(work: Path, hf: Path, results: common.Results) -> None:
    opts = options(hf)
    topo = reinit(2, 1)
    actor = model.build_actor(opts, topo)
    with torch.no_grad():  # weights of their own, so a load from HF would not pass
        for p in model.unwrap(actor.chunks[0]).parameters():
            p.mul_(1.01).add_(0.003)
    batch = common.make_batch(8, seed=3)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    step.train_step(actor, shard, plan, SFT)  # Adam state to save
    ckpt, source = work / "foreign", work / "foreign_hf"
    bare_megatron_save(actor, ckpt, 7)
    export.save_hf(actor.chunks, actor.arch, topo, source, base_dir=hf)
    want = hf_tensors(actor.chunks, actor.arch)
    tp2_lp = log_probs(actor.chunks, actor.config, actor.arch.vocab_size)
    resumed = model.build_actor(opts, topo, load_weights=False)
    state = checkpoint.load(resumed, ckpt, named=True)
    assert state is not None
    results.set(
        "foreign/resume_tp2",
        {
            "rollout_id": state.rollout_id,
            "weights": same(hf_tensors(resumed.chunks, resumed.arch), want),
            "adam": optimizer_equal(actor, resumed),
            # Adam's step count (bias correction) from the checkpoint's optimizer param groups
            "adam_step": [checkpoint._adam_step(resumed), checkpoint._adam_step(actor)],
        },
    )
    del actor, resumed
    for layout, (tp, pp) in {"tp1": (1, 1), "pp2": (1, 2)}.items():
        topo = reinit(tp, pp)
        ref = model.build_reference(opts, topo, load_weights=False)
        used = checkpoint.load_weights_only(ref.chunks, ckpt)
        from_hf = model.build_reference(options(source), topo)
        got_lp = log_probs(ref.chunks, ref.config, ref.arch.vocab_size)
        results.set(
            f"foreign/{layout}",
            {
                "used": str(used),
                "weights": same(hf_tensors(ref.chunks, ref.arch), want),
                "log_probs_equal_hf_built": got_lp
                == log_probs(from_hf.chunks, from_hf.config, ref.arch.vocab_size),
                "max_diff_to_tp2": max(abs(a - b) for a, b in zip(got_lp, tp2_lp, strict=True)),
            },
        )
        if layout == "tp1":
            # --use-opd --opd-type megatron: the teacher from --opd-teacher-load at
            # --opd-teacher-ckpt-step 7 is that checkpoint (the same log-probs as the HF-built model).
            from tether.train.algorithms.opd_teacher import build_teacher

            teacher_cfg = AlgorithmConfig(
                use_opd=True, opd_type="megatron", opd_teacher_load=str(ckpt), opd_teacher_ckpt_step=7
            )
            teacher = build_teacher(opts, topo, teacher_cfg)
            teacher_lp = log_probs(teacher.chunks, teacher.config, teacher.arch.vocab_size)
            results.set(
                "foreign/opd_teacher",
                {
                    "frozen": not any(p.requires_grad for p in teacher.chunks[0].parameters()),
                    "log_probs_equal_hf_built": teacher_lp
                    == log_probs(from_hf.chunks, from_hf.config, teacher.arch.vocab_size),
                },
            )
    topo = reinit(1, 1)
    actor = model.build_actor(opts, topo, load_weights=False)
    try:
        checkpoint.load(actor, ckpt, named=True)
        results.set("foreign/resume_tp1_refused", "loaded")
    except RuntimeError as exc:
        results.set("foreign/resume_tp1_refused", str(exc))


def optimizer_equal(a: model.Actor, b: model.Actor) -> bool:
    """Adam's exp_avg / exp_avg_sq of every parameter shard are equal."""
    sa = [inner.state for inner in checkpoint._inner_optimizers(a)]
    sb = [inner.state for inner in checkpoint._inner_optimizers(b)]
    ok = True
    for x, y in zip(sa, sb, strict=True):
        vx, vy = list(x.values()), list(y.values())
        ok = ok and len(vx) == len(vy) > 0
        for p, q in zip(vx, vy, strict=True):
            ok = (
                ok
                and torch.equal(p["exp_avg"], q["exp_avg"])
                and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
            )
    return bool(ok)


def bare_gpt(config_src: Any, gpt_src: Any) -> Any:
    """A GPTModel built with megatron.core alone, the shape of `gpt_src` (no tether code)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    c = config_src
    config = TransformerConfig(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups,
        kv_channels=c.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=c.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=c.add_qkv_bias,
        qk_layernorm=c.qk_layernorm,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=c.qk_layernorm, normalization="RMSNorm"),
        vocab_size=gpt_src.vocab_size,
        max_sequence_length=gpt_src.max_sequence_length,
        share_embeddings_and_output_weights=gpt_src.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=gpt_src.rotary_base,
    )


def tether_save(work: Path, hf: Path, results: common.Results) -> None:
    from megatron.core import dist_checkpointing

    topo = reinit(1, 1)
    actor = model.build_actor(options(hf), topo)
    batch = common.make_batch(8, seed=4)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    step.train_step(actor, shard, plan, SFT)
    ckpt = work / "saved"
    state = checkpoint.RunState(step=3, rollout_id=3, weight_version=4, data_position={"next": 4})
    path = checkpoint.save(actor, ckpt, state)
    rng_after_save = torch.rand(4).tolist()
    results.set("tether_save/rng_after_save", rng_after_save)
    gpt_src = model.unwrap(actor.chunks[0])
    fresh = bare_gpt(actor.config, gpt_src)
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, str(path))
    fresh.load_state_dict(loaded["model"], strict=False)
    src = dict(gpt_src.state_dict())
    mism = [
        k
        for k, v in fresh.state_dict().items()
        if torch.is_tensor(v) and (k not in src or not torch.equal(v, src[k]))
    ]
    common_sd = dist_checkpointing.load_common_state_dict(str(path))
    args = common_sd["args"]
    results.set(
        "tether_save/bare_load",
        {
            "mismatched": mism,
            "count": sum(1 for v in fresh.state_dict().values() if torch.is_tensor(v)),
            "tracker": (ckpt / "latest_checkpointed_iteration.txt").read_text(),
            "iteration": common_sd["iteration"],
            "checkpoint_version": common_sd["checkpoint_version"],
            "args": [
                args.num_layers,
                args.hidden_size,
                args.num_attention_heads,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
                args.data_parallel_size,
                args.add_position_embedding,
                args.padded_vocab_size,
            ],
            "config": [actor.config.num_layers, actor.config.hidden_size, actor.config.num_attention_heads],
            "scheduler": sorted(common_sd["opt_param_scheduler"]),
            "content_metadata": common_sd["content_metadata"]["distrib_optim_sharding_type"],
            "has_optimizer": any(
                k.startswith("optimizer.") for k in dist_checkpointing.load_tensors_metadata(str(path))
            ),
        },
    )
    # resume: the same actor state back, in a fresh actor
    want = hf_tensors(actor.chunks, actor.arch)
    fresh_actor = model.build_actor(options(hf), topo, load_weights=False)
    loaded_state = checkpoint.load(fresh_actor, ckpt)
    assert loaded_state is not None
    results.set(
        "resume/new_layout",
        {
            "state": msgspec.to_builtins(loaded_state),
            "weights": same(hf_tensors(fresh_actor.chunks, fresh_actor.arch), want),
            "adam": optimizer_equal(actor, fresh_actor),
            "rng": torch.rand(4).tolist() == rng_after_save,
        },
    )
    # tether's previous layout, written as the previous save wrote it, still resumes
    legacy = work / "legacy"
    write_legacy(actor, legacy, state)
    other = model.build_actor(options(hf), topo, load_weights=False)
    got = checkpoint.load(other, legacy)
    results.set(
        "resume/legacy_layout",
        {
            "state": None if got is None else msgspec.to_builtins(got),
            "weights": same(hf_tensors(other.chunks, other.arch), want),
            "adam": optimizer_equal(actor, other),
        },
    )


def write_legacy(actor: model.Actor, root: Path, state: checkpoint.RunState) -> None:
    """iter_N/{model_optim/, rng/, run_state.msgpack, digests.msgpack} + `latest`, as before."""
    from megatron.core import dist_checkpointing

    d = root / checkpoint.iter_dir_name(state.step)
    if dist.get_rank() == 0:
        (d / "model_optim").mkdir(parents=True)
        (d / "rng").mkdir()
    dist.barrier()
    dist_checkpointing.save(checkpoint._sharded_state(actor, is_loading=False), str(d / "model_optim"))
    rng = checkpoint.capture_rng()
    (d / "rng" / f"rank_{dist.get_rank():05d}.msgpack").write_bytes(msgspec.msgpack.encode(rng))
    dist.barrier()
    if dist.get_rank() == 0:
        state.scheduler = actor.scheduler.state_dict()
        state.optimizer_step = checkpoint._adam_step(actor)
        (d / "run_state.msgpack").write_bytes(msgspec.msgpack.encode(state))
        checkpoint.write_digests(d, name="digests.msgpack")
        (root / "latest").write_text(str(state.step))
    dist.barrier()


TE_TO_LOCAL = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.input_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight",
}


def te_names(work: Path, hf: Path, results: common.Results) -> None:
    """Checkpoints under the other spec's names, written with bare dist_checkpointing.save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    topo = reinit(1, 1)
    src = model.build_reference(options(hf), topo)
    with torch.no_grad():
        for p in src.chunks[0].parameters():
            p.add_(0.01)
    want = hf_tensors(src.chunks, src.arch)
    for variant in ("te", "local"):
        sd = model.unwrap(src.chunks[0]).sharded_state_dict()
        out: dict[str, Any] = {}
        for name, value in sd.items():
            if isinstance(value, ShardedObject):
                if variant == "te":  # TE's FP8 metadata: a BytesIO, for modules the local spec lacks too
                    value.data = io.BytesIO(b"te-fp8-meta")
                    out[name] = value
                    extra = name.replace("linear_proj._extra_state", "core_attention._extra_state")
                    if extra != name:
                        out[extra] = ShardedObject(
                            value.key.replace("linear_proj", "core_attention"),
                            io.BytesIO(b"te-attn"),
                            value.global_shape,
                            value.global_offset,
                            replica_id=value.replica_id,
                        )
                continue  # the local-name variant: written by a converter without extra state
            if variant == "local" and isinstance(value, ShardedTensor) and value.key in TE_TO_LOCAL:
                value.key = TE_TO_LOCAL[value.key]
            out[name] = value
        root = work / f"named_{variant}"
        target = root / "release"
        if dist.get_rank() == 0:
            target.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save({"model": out, "iteration": 0, "checkpoint_version": 3.0}, str(target))
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text("release")
        dist.barrier()
        keys = set(dist_checkpointing.load_tensors_metadata(str(target)))
        dst = model.build_reference(options(hf), topo, load_weights=False)
        checkpoint.load_weights_only(dst.chunks, root)
        results.set(
            f"te_names/{variant}",
            {
                "local_keys_in_ckpt": sorted(k for k in keys if k in TE_TO_LOCAL.values()),
                "weights": same(hf_tensors(dst.chunks, dst.arch), want),
            },
        )


def flags(work: Path, hf: Path, results: common.Results) -> None:
    import multiprocessing as mp

    from megatron.core import dist_checkpointing

    from tether.train.checkpoint import async_save as checkpoint_async
    from tether.train.checkpoint.layout import select_checkpoint_step

    topo = reinit(1, 1)
    actor = model.build_actor(options(hf), topo)
    batch = common.make_batch(8, seed=5)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)

    def train() -> None:
        step.train_step(actor, shard, plan, SFT)

    def fresh() -> model.Actor:
        return model.build_actor(options(hf), topo, load_weights=False)

    train()
    # --no-save-optim: weights and run state only; the resume starts a fresh optimizer
    root = work / "no_save_optim"
    path = checkpoint.save(actor, root, checkpoint.RunState(step=1, rollout_id=1), save_optim=False)
    want = hf_tensors(actor.chunks, actor.arch)
    other = fresh()
    state = checkpoint.load(other, root)
    results.set(
        "flags/no_save_optim",
        {
            "optimizer_tensors": sorted(
                k for k in dist_checkpointing.load_tensors_metadata(str(path)) if "optim" in k
            ),
            "args_no_save_optim": dist_checkpointing.load_common_state_dict(str(path))["args"].no_save_optim,
            "rollout_id": None if state is None else state.rollout_id,
            "weights": same(hf_tensors(other.chunks, other.arch), want),
            "adam_step": checkpoint._adam_step(other),
        },
    )
    # --no-load-optim / --no-load-rng of a full checkpoint; --ckpt-step of an older one
    root = work / "steps"
    checkpoint.save(actor, root, checkpoint.RunState(step=2, rollout_id=2, data_position={"at": 2}))
    at_two = hf_tensors(actor.chunks, actor.arch)
    train()
    checkpoint.save(actor, root, checkpoint.RunState(step=3, rollout_id=3))
    rng_after = torch.rand(4).tolist()
    other = fresh()
    torch.manual_seed(99)
    state = checkpoint.load(other, root, load_optim=False, load_rng=False)
    results.set(
        "flags/no_load_optim_rng",
        {
            "rollout_id": None if state is None else state.rollout_id,
            "weights": same(hf_tensors(other.chunks, other.arch), hf_tensors(actor.chunks, actor.arch)),
            "adam_step": checkpoint._adam_step(other),
            "rng_restored": torch.rand(4).tolist() == rng_after,
        },
    )
    other = fresh()
    state = checkpoint.load(other, select_checkpoint_step(root, 2), named=True)
    results.set(
        "flags/ckpt_step",
        {
            "tracker": (root / "latest_checkpointed_iteration.txt").read_text(),
            "rollout_id": None if state is None else state.rollout_id,
            "data_position": None if state is None else state.data_position,
            "weights": same(hf_tensors(other.chunks, other.arch), at_two),
            "adam_step": checkpoint._adam_step(other),
        },
    )
    # --async-save
    root = work / "async"
    checkpoint.save(actor, root, checkpoint.RunState(step=3, rollout_id=3))
    gate = mp.get_context("fork").Event()
    saver = checkpoint_async.AsyncCheckpointer(write_gate=gate)
    want = hf_tensors(actor.chunks, actor.arch)
    pending = saver.start_save(actor, root, checkpoint.RunState(step=4, rollout_id=4))
    before = {
        "shards_written": sorted(p.name for p in pending.tmp.glob("*.distcp")),
        "tracker": (root / "latest_checkpointed_iteration.txt").read_text(),
        "resume_point": str(checkpoint.find_checkpoint(root)),
    }
    train()  # the run goes on while the writer is held back
    moved = same(hf_tensors(actor.chunks, actor.arch), want)
    before["still_no_shards"] = not list(pending.tmp.glob("*.distcp"))
    gate.set()
    final = saver.finalize(pending)
    checkpoint.validate_checkpoint(final)  # every file whole, digests recorded
    other = fresh()
    state = checkpoint.load(other, root)
    results.set(
        "flags/async_save",
        {
            **before,
            "trained_after_save": bool(moved),
            "final": str(final),
            "tracker_after": (root / "latest_checkpointed_iteration.txt").read_text(),
            "rollout_id": None if state is None else state.rollout_id,
            "weights_at_save": same(hf_tensors(other.chunks, other.arch), want),
            "tmp_left": pending.tmp.exists(),
        },
    )


def moe_options(hf_dir: Path, tp: int, etp: int | None) -> model.ModelOptions:
    return model.ModelOptions(
        hf_checkpoint=str(hf_dir),
        algorithm=AlgorithmConfig(lr=3e-3),
        megatron=MegatronConfig(
            weight_decay=0.0,
            adam_beta2=0.98,
            lr_decay_style="constant",
            use_distributed_optimizer=True,
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            expert_tensor_parallel_size=etp,
        ),
    )


def expert_layout(work: Path, hf: Path, results: common.Results) -> None:
    """A MoE model trained and saved with experts at ETP=1 under TP=2 (slime's layout): it resumes at
    that layout with its weights and Adam state, and its weights load at TP=1 (Megatron reshards)."""
    families = {MOE_FAMILY: {"arch": MOE_FAMILY}}
    if dist.get_rank() == 0:  # one writer; the others read it after the barrier
        common.make_models(work / "models", families=families)
    dist.barrier()
    moe = common.make_models(work / "models", families=families)[MOE_FAMILY]
    topo = reinit(2, 1, etp=1)
    actor = model.build_actor(moe_options(moe, 2, 1), topo)
    batch = common.make_batch(8, seed=5)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    step.train_step(actor, shard, plan, SFT)
    ckpt = work / "etp1"
    checkpoint.save(
        actor, ckpt, checkpoint.RunState(step=1, rollout_id=1, weight_version=1, data_position={})
    )
    want = hf_tensors(actor.chunks, actor.arch)
    resumed = model.build_actor(moe_options(moe, 2, 1), topo, load_weights=False)
    state = checkpoint.load(resumed, ckpt, named=True)
    results.set(
        "expert_layout/resume",
        {
            "loaded": state is not None,
            "weights": same(hf_tensors(resumed.chunks, resumed.arch), want),
            "adam": optimizer_equal(actor, resumed),
            "etp": int(resumed.config.expert_tensor_parallel_size),
        },
    )
    del actor, resumed
    topo = reinit(1, 1)
    ref = model.build_reference(moe_options(moe, 1, None), topo, load_weights=False)
    checkpoint.load_weights_only(ref.chunks, ckpt)
    results.set("expert_layout/tp1_weights", same(hf_tensors(ref.chunks, ref.arch), want))


def slime_wrapped_save(actor: model.Actor, root: Path, hf: Path) -> None:
    """What slime's HF -> torch_dist converter writes for Qwen3.5 (release/, megatron.core calls only):
    its spec wraps transformers' gated DeltaNet and input norm in the attention module, so their
    tensors are the HF ones, whole on every rank, under `self_attention.linear_attn.*` and
    `self_attention.input_layernorm.weight`; every other tensor as Megatron names it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from tether.train.model.hf_convert import HFWeights

    gpt = model.unwrap(actor.chunks[0])
    sd = gpt.sharded_state_dict()
    source = HFWeights(hf)
    prefix = actor.arch.hf_prefix
    for local, layer in enumerate(gpt.decoder.layers):
        if not isinstance(layer.self_attention, GatedDeltaNet):
            continue
        for key in [k for k in sd if k.startswith(f"decoder.layers.{local}.")]:
            rest = key.split(".", 3)[3]
            if rest.startswith("self_attention.") or rest == "input_layernorm.weight":
                del sd[key]
        i = int(layer.layer_number) - 1
        hf_layer = f"{prefix}layers.{i}."
        for name in source.names():
            if name.startswith(hf_layer + "linear_attn."):
                key = f"decoder.layers.{i}.self_attention." + name.removeprefix(hf_layer)
            elif name == hf_layer + "input_layernorm.weight":
                key = f"decoder.layers.{i}.self_attention.input_layernorm.weight"
            else:
                continue
            sd[key] = ShardedTensor.from_rank_offsets(key, source.get(name), replica_id=dist.get_rank())
    state = {
        "model": sd,
        "iteration": 0,
        "checkpoint_version": 3.0,
        "args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
    }
    target = root / "release"
    if dist.get_rank() == 0:
        target.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(target))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("release")
    dist.barrier()


def slime_linear_attention(work: Path, hf: Path, results: common.Results) -> None:
    """slime's Megatron checkpoint of Qwen3.5 (transformers' linear attention inside its spec) loads
    into tether's GatedDeltaNet at TP 1 and TP 2: every weight equals the HF checkpoint's."""
    if dist.get_rank() == 0:
        common.make_models(work / "models", families=QWEN3_5)
    dist.barrier()
    source = common.make_models(work / "models", families=QWEN3_5)["qwen3_5"]
    opts = options(source)
    topo = reinit(1, 1)
    actor = model.build_actor(opts, topo)
    want = hf_tensors(actor.chunks, actor.arch)
    ckpt = work / "slime_qwen3_5"
    slime_wrapped_save(actor, ckpt, source)
    del actor
    for tp in (1, 2):
        topo = reinit(tp, 1)
        megatron = msgspec.structs.replace(opts.megatron, sequence_parallel=tp > 1)  # linear attention's rule
        ref = model.build_reference(dataclasses.replace(opts, megatron=megatron), topo, load_weights=False)
        checkpoint.load_weights_only(ref.chunks, ckpt)
        results.set(f"slime_linear_attention/tp{tp}", same(hf_tensors(ref.chunks, ref.arch), want))


QWEN3_5 = {"qwen3_5": {"arch": "qwen3_5"}}
GLM5 = {"glm_moe_dsa": {"arch": "glm_moe_dsa", "layers": 4}}


def sparse_attention(work: Path, hf: Path, results: common.Results) -> None:
    """GLM-5 (sparse attention: its indexers under slime's names, replicated over TP) trained and
    saved at TP=2: it resumes there with its weights and Adam state, and its weights load at PP=2
    (a stage starting on an indexer layer) equal to the saved model's."""
    if dist.get_rank() == 0:
        common.make_models(work / "models", families=GLM5)
    dist.barrier()
    source = common.make_models(work / "models", families=GLM5)["glm_moe_dsa"]
    topo = reinit(2, 1)
    actor = model.build_actor(moe_options(source, 2, None), topo)
    batch = common.make_batch(8, seed=6)
    shard, plan = common.shard_and_plan(batch, topo.dp_size, topo.dp_rank)
    step.train_step(actor, shard, plan, SFT)
    ckpt = work / "glm5"
    checkpoint.save(
        actor, ckpt, checkpoint.RunState(step=1, rollout_id=1, weight_version=1, data_position={})
    )
    want = hf_tensors(actor.chunks, actor.arch)
    resumed = model.build_actor(moe_options(source, 2, None), topo, load_weights=False)
    loaded = checkpoint.load(resumed, ckpt, named=True) is not None
    results.set(
        "sparse_attention/resume",
        {
            "loaded": loaded,
            "weights": same(hf_tensors(resumed.chunks, resumed.arch), want),
            "adam": optimizer_equal(actor, resumed),
            "indexer": sorted(
                n.split(".", 3)[3]
                for n, _ in model.unwrap(resumed.chunks[0]).named_parameters()
                if "self_attention.w" in n and n.startswith("decoder.layers.0.")
            ),
        },
    )
    del actor, resumed
    topo = reinit(1, 2)
    opts = moe_options(source, 1, None)
    opts = dataclasses.replace(
        opts, megatron=msgspec.structs.replace(opts.megatron, pipeline_model_parallel_size=2)
    )
    ref = model.build_reference(opts, topo, load_weights=False)
    checkpoint.load_weights_only(ref.chunks, ckpt)
    results.set("sparse_attention/pp2_weights", same(hf_tensors(ref.chunks, ref.arch), want))


def main() -> None:
    work = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (work / "results").mkdir(parents=True, exist_ok=True)
    results = common.Results(work / "results", rank)
    only = set(filter(None, os.environ.get("CHECKS_ONLY", "").split(",")))  # to debug one check
    parallel.init_distributed(1, 1, seed=1234)
    if rank == 0:
        common.make_models(work / "models")
    dist.barrier()
    hf = common.make_models(work / "models")[FAMILY]
    for name, fn in (
        ("foreign", foreign),
        ("tether_save", tether_save),
        ("te_names", te_names),
        ("flags", flags),
        ("expert_layout", expert_layout),
        ("slime_linear_attention", slime_linear_attention),
        ("sparse_attention", sparse_attention),
    ):
        if only and name not in only:
            continue
        results.record(f"{name}/done", lambda f=fn: f(work, hf, results) or True)
        dist.barrier()
    results.set("done", True)
    parallel.destroy()


if __name__ == "__main__":
    main()

"""A trainer rank: `python -m tether.train.rank.worker` under torchrun, serving RPC to the head.

    torchrun --nnodes N --node-rank R --nproc-per-node G --rdzv-endpoint HOST:PORT \\
        -m tether.train.rank.worker --rpc-address-dir RUN_DIR/trainer [--bind-host 127.0.0.1]

Address discovery: every rank binds `tcp://BIND_HOST:0` and writes
`RUN_DIR/trainer/rank_{RANK:05d}.json` (`{"rank", "address", "pid", "host"}`) atomically once
it serves; the head waits for WORLD_SIZE files and connects to each. The run secret comes
from the environment (TETHER_SECRET), never the command line.

End of the job: the head calls `shutdown` on every rank; each rank closes its weight-sync
transport, stops serving, finishes the work on its thread, leaves its process groups and
exits 0, so torchrun exits 0 and writes no error file. The head signals only ranks that have
not exited within its grace period. A rank that raises (outside an RPC call, whose errors go to
the caller) leaves its traceback in torchrun's error file (TORCHELASTIC_ERROR_FILE), which
`main` records.

The RPC surface is `tether.train.rank.protocol.RankApi` (one request Struct in, one result Struct
out), which `TrainerWorker` implements and the head's `RankClient` calls; its ordering contract
is there. Each rank runs the collective calls on one dedicated thread, in arrival order, so the
event loop keeps answering `health` and pings while a step runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, TypeVar

from tether.runtime.errors import ConfigError
from tether.sync.config import WeightSyncConfig
from tether.sync.ledger import LedgerEntry
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.rank.addresses import write_address

# Imported at run time, not only for mypy: the RPC server reads these annotations of the
# served methods to decode each request as its Struct.
from tether.train.rank.protocol import (
    CompareHFRequest,
    CompareHFResult,
    DamagedCheckpoint,
    ExportRequest,
    ExportResult,
    InitRequest,
    LoadedState,
    LoadRequest,
    LogProbsRequest,
    LogProbsResult,
    RankApi,
    SaveRequest,
    SaveResult,
    TrainRequest,
    TrainResult,
    UpdateWeightsRequest,
    ValuesRequest,
    ValuesResult,
    WeightUpdateResult,
    WorkerInfo,
)

T = TypeVar("T")
Needs = Literal["all", "weights", "none"]
"""What of an offloaded trainer a piece of work needs on the device (`TrainerWorker._run`)."""


def model_options(hf_checkpoint: str, algorithm: AlgorithmConfig, megatron: MegatronConfig) -> Any:
    """The model builder's options from the two trainer config slices (each Megatron flag reaches
    its Megatron config in `tether.train.model.megatron_args`)."""
    from tether.train.model.build import ModelOptions

    return ModelOptions(hf_checkpoint=hf_checkpoint, algorithm=algorithm, megatron=megatron)


class TrainerWorker(RankApi):
    """The RPC target of one rank. Public async methods are the RPC surface (`RankApi`)."""

    def __init__(self, executor: ThreadPoolExecutor, node_address: str = "") -> None:
        self._executor = executor
        self._node_address = node_address  # this node's address toward the engines
        self._stop = asyncio.Event()
        self._actor: Any = None
        self._ref: Any = None
        self._teacher: Any = None  # --opd-type megatron: the distillation teacher
        self._topo: Any = None
        self._algorithm: AlgorithmConfig | None = None
        self._hf_checkpoint = ""
        self._temperature = 1.0
        self._steps = 0
        self._busy = False
        self._transport: Any = None
        self._engines: list[Any] = []
        self._engine_urls: list[str] = []  # the engines `_transport` was built for
        self._offload_train = False
        self._offloaded: Any = None  # what offload_trainer moved to host, until the next work
        self._routing: Any = None  # the actor's MoE routing replay (RoutingReplay), when asked for
        self._pending_save: Any = None  # an --async-save checkpoint not finalised yet (PendingSave)
        self._async_saver: Any = None  # its AsyncCheckpointer, made on the first --async-save
        self._old_actor: Any = None  # --keep-old-actor: the old actor's weights (train.old_actor.OldActor)
        self._role = "actor"  # or "critic" (InitRequest.role): which step `train` runs
        self._profiler: Any = None  # the profiling slice's RankProfiler, when it asks for one
        self._megatron_hooks: Any = None  # slime's --custom-megatron-*-path hooks (MegatronHooks), when named

    async def _run(self, fn: Callable[[], T], needs: Needs = "all") -> T:
        """Run torch/Megatron work on this rank's single worker thread, in call order; what it
        `needs` of the trainer's memory comes back to the device first when --offload-train moved
        it out: all of it, the actor's weights only (an export), or none."""

        def resident() -> T:
            self._make_resident(needs)
            return fn()

        self._busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, resident)
        finally:
            self._busy = False

    def _make_resident(self, needs: Needs) -> None:
        state = self._offloaded
        if state is None or needs == "none":
            return
        from tether.train.state.offload import onload_trainer, onload_weights

        if needs == "weights":
            onload_weights(state)
            return
        onload_trainer(state)
        self._offloaded = None

    def _require_init(self) -> Any:
        if self._actor is None:
            raise RuntimeError("call init(...) on every rank first")
        return self._actor

    async def init(self, request: InitRequest) -> WorkerInfo:
        """Join the job's process groups and build the actor (and the reference model for KL).

        The reference comes from --ref-load when set (a Megatron checkpoint in any layout, or an
        HF directory), else from the HF checkpoint. The head then calls `load` when the actor
        starts from a checkpoint (`tether.train.checkpoint.layout.choose_start`).
        """
        if self._actor is not None:
            raise RuntimeError("init was already called on this rank")
        hf_checkpoint, algorithm, megatron = request.hf_checkpoint, request.algorithm, request.megatron
        temperature = request.temperature
        if temperature <= 0:
            raise ConfigError("--rollout-temperature", temperature, "must be > 0 for log-probs")

        def work() -> WorkerInfo:
            from tether.train.checkpoint import load_save as checkpoint
            from tether.train.checkpoint.layout import is_hf_checkpoint
            from tether.train.model import build as model
            from tether.train.model import megatron_args
            from tether.train.model.hf_config import check_architecture_flags, load_arch
            from tether.train.parallel import topology as parallel

            arch = load_arch(hf_checkpoint)
            check_architecture_flags(arch, megatron.architecture())
            topo = parallel.init_distributed(**megatron_args.init_distributed_kwargs(megatron, algorithm))
            self._start_profiler(request)
            from tether.train.rank.megatron_hooks import MegatronHooks

            self._megatron_hooks = MegatronHooks.load(algorithm, megatron, hf_checkpoint)
            if self._megatron_hooks is not None:
                self._megatron_hooks.after_init()  # slime: at the end of Megatron's initialisation
            opts = model_options(hf_checkpoint, algorithm, megatron)
            # The PPO critic: the actor's model with a value head; no routing replay, no reference.
            critic = request.role == "critic"
            self._actor = model.build_actor(opts, topo, value_head=critic)
            if not critic and (algorithm.use_routing_replay or algorithm.use_rollout_routing_replay):
                from tether.train.parallel.routing_replay import RoutingReplay

                r3 = algorithm.use_rollout_routing_replay
                self._routing = RoutingReplay.install(
                    self._actor.chunks,
                    from_rollout=r3,
                    flag="--use-rollout-routing-replay" if r3 else "--use-routing-replay",
                )
            needs_ref = not critic and (
                request.with_reference or algorithm.use_kl_loss or algorithm.kl_coef > 0
            )
            if needs_ref:
                ref_load = algorithm.ref_load
                ref_hf = ref_load is not None and is_hf_checkpoint(Path(ref_load))
                self._ref = model.build_reference(opts, topo, load_weights=ref_load is None)
                if ref_load is not None and ref_hf:
                    model.load_hf_weights(self._ref.chunks, self._ref.arch, ref_load, topo, self._ref.weights)
                elif ref_load is not None:
                    # slime's load_other_checkpoint: --ref-ckpt-step, else --ckpt-step.
                    from tether.train.checkpoint.layout import select_checkpoint_step

                    ref_step = algorithm.ref_ckpt_step
                    flag = "--ref-ckpt-step" if ref_step is not None else "--ckpt-step"
                    if ref_step is None:
                        ref_step = algorithm.ckpt_step
                    checkpoint.load_weights_only(
                        self._ref.chunks, select_checkpoint_step(ref_load, ref_step, flag=flag)
                    )
            if not critic and algorithm.use_opd and algorithm.opd_type == "megatron":
                from tether.train.algorithms.opd_teacher import build_teacher

                self._teacher = build_teacher(opts, topo, algorithm)
            self._topo = topo
            self._algorithm = algorithm
            self._hf_checkpoint = hf_checkpoint
            self._temperature = temperature
            self._offload_train = request.offload_train
            self._role = request.role
            if algorithm.keep_old_actor and not critic:
                from tether.train.state.old_actor import OldActor

                self._old_actor = OldActor(self._actor.chunks)
            if self._profiler is not None:
                self._profiler.initialized()
            return self._info()

        return await self._run(work)

    def _start_profiler(self, request: InitRequest) -> None:
        """--use-pytorch-profiler / --record-memory-history: memory history starts now, once the
        rank joined its process groups and before its models are built (worker thread)."""
        from tether.train.profiling.rank_profiler import rank_profiler

        rank = int(os.environ.get("RANK", "0"))
        self._profiler = rank_profiler(request.profile, request.profile_dir, rank=rank, role=request.role)
        if self._profiler is not None:
            self._profiler.started()

    def _profiled(
        self, phase: Literal["train_actor", "train_log_probs"]
    ) -> contextlib.AbstractContextManager[None]:
        """The --profile-target phase `phase` around one of its steps (worker thread)."""
        return self._profiler.phase(phase) if self._profiler is not None else contextlib.nullcontext()

    def _info(self) -> WorkerInfo:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        t = self._topo
        if t is None:
            return WorkerInfo(rank=rank, world_size=world, initialized=False, busy=self._busy)
        return WorkerInfo(
            rank=rank,
            world_size=world,
            initialized=True,
            tp_rank=t.tp_rank,
            tp_size=t.tp_size,
            pp_rank=t.pp_rank,
            pp_size=t.pp_size,
            dp_rank=t.dp_rank,
            dp_size=t.dp_size,
            is_sync_source=t.is_sync_source,
            steps=self._steps,
            busy=self._busy,
        )

    async def train(self, request: TrainRequest) -> TrainResult:
        """One optimizer step on this rank's DP shard, micro-batched by its plan; the step's metrics."""
        actor = self._require_init()
        shard, plan = request.shard, request.plan
        shard.validate()
        algorithm = self._algorithm
        assert algorithm is not None

        def work() -> TrainResult:
            from tether.train.rank import step

            if algorithm.reset_optimizer_states and request.first_of_rollout:
                # slime clears the optimizer's history at the start of each rollout's training
                from tether.train.state.optimizer_reset import reset_optimizer_states

                reset_optimizer_states(actor.optimizer)
            hooks = self._megatron_hooks
            before = (
                None
                if hooks is None
                else hooks.train_step_call(
                    request.rollout_id, request.step_id, actor.chunks, actor.optimizer, actor.scheduler
                )
            )
            if self._role == "critic":
                from tether.train.algorithms.critic import value_train_step

                with self._profiled("train_actor"):
                    metrics = value_train_step(actor, shard, plan, algorithm, before=before)
                if self._offload_train:
                    # The critic never syncs weights: it leaves the device after each of its steps
                    # (the actor's turn on the devices it shares follows); `_run` brings it back.
                    from tether.train.state.offload import offload_trainer

                    self._offloaded = offload_trainer(actor)
                self._steps += 1
                metrics["rollout_id"] = float(request.rollout_id)
                self._rollout_profiled(request)
                return TrainResult(metrics=metrics)
            with self._profiled("train_actor"):
                metrics = step.train_step(
                    actor,
                    shard,
                    plan,
                    algorithm,
                    step.StepOptions(temperature=self._temperature),
                    routing=self._routing,
                    before=before,
                )
            self._steps += 1
            metrics["rollout_id"] = float(request.rollout_id)
            if request.last_of_rollout and self._ref is not None:
                self._maybe_update_reference(request.rollout_id)
            self._rollout_profiled(request)
            return TrainResult(metrics=metrics)

        return await self._run(work)

    def _rollout_profiled(self, request: TrainRequest) -> None:
        """After a rollout's last train step: train_overall's step, a due memory snapshot."""
        if request.last_of_rollout and self._profiler is not None:
            self._profiler.rollout_trained(request.rollout_id)

    def _maybe_update_reference(self, rollout_id: int) -> None:
        """--ref-update-interval: once rollout `rollout_id` has trained, the reference may take the
        actor's weights (worker thread)."""
        from tether.train.model import build as model
        from tether.train.state.ref_update import ref_update_due, update_reference

        assert self._algorithm is not None
        if ref_update_due(self._algorithm.ref_update_interval, rollout_id):
            model.sync_params(self._actor.chunks)  # a pending parameter all-gather lands first
            update_reference(self._actor.chunks, self._ref.chunks)

    async def compute_values(self, request: ValuesRequest) -> ValuesResult:
        """The critic's per-response-token values over this rank's shard (role "critic" only)."""
        critic = self._require_init()
        if self._role != "critic":
            raise ValueError("compute_values: this rank trains the actor, not a critic (InitRequest.role)")
        request.shard.validate()

        def work() -> ValuesResult:
            from tether.train.algorithms.critic import compute_values

            hooks = self._megatron_hooks
            before = None if hooks is None else hooks.log_prob_call(critic.chunks, "")
            return ValuesResult(values=compute_values(critic, request.shard, request.plan, before=before))

        return await self._run(work)

    async def compute_log_probs(self, request: LogProbsRequest) -> LogProbsResult:
        """Per-response-token log-probs of the request's model ("actor" for old, "ref" for reference)."""
        actor = self._require_init()
        shard, plan, model = request.shard, request.plan, request.model
        if model == "actor":
            chunks, config = actor.chunks, actor.config
        elif model == "ref":
            if self._ref is None:
                raise ValueError(
                    "model='ref': no reference model (init with_reference, --use-kl-loss or --kl-coef)"
                )
            chunks, config = self._ref.chunks, self._ref.config
        elif model == "teacher":
            if self._teacher is None:
                raise ValueError("model='teacher': no teacher model (--use-opd --opd-type megatron)")
            chunks, config = self._teacher.chunks, self._teacher.config
        else:
            raise ValueError(f"model={model!r}: expected 'actor', 'ref' or 'teacher'")
        shard.validate()

        def work() -> LogProbsResult:
            from tether.train.rank import step

            chunk = self._algorithm.log_probs_chunk_size if self._algorithm is not None else -1
            opts = step.StepOptions(
                temperature=self._temperature, with_entropy=request.with_entropy, chunk_size=chunk
            )
            # Only the actor's routers replay; the reference routes on its own (as in slime).
            routing = self._routing if model == "actor" else None
            from tether.train.rank.megatron_hooks import STORE_PREFIX

            hooks = self._megatron_hooks
            before = None if hooks is None else hooks.log_prob_call(chunks, STORE_PREFIX[model])
            with self._profiled("train_log_probs"), self._old_actor_weights(model):
                lp, ent = step.compute_log_probs(
                    chunks, config, actor.arch.vocab_size, shard, plan, opts, routing=routing, before=before
                )
            return LogProbsResult(log_probs=lp, entropy=ent)

        return await self._run(work)

    def _old_actor_weights(self, model: str) -> contextlib.AbstractContextManager[None]:
        """--keep-old-actor: the old log-probs ("actor") are computed with the old actor's weights
        swapped in, and the actor's own restored after (worker thread)."""
        if model != "actor" or self._old_actor is None:
            return contextlib.nullcontext()
        from tether.train.model import build as models

        models.sync_params(self._actor.chunks)  # a pending parameter all-gather lands first
        return self._old_actor.active(self._actor.chunks)

    def _advance_old_actor(self, update_weights_interval: int) -> None:
        from tether.train.model import build as models

        models.sync_params(self._actor.chunks)
        self._old_actor.after_weight_update(self._actor.chunks, update_weights_interval)

    def _restart_old_actor(self) -> None:
        """The actor's weights were loaded: they are the old actor's start weights (worker thread)."""
        if self._old_actor is not None:
            self._old_actor.restart(self._actor.chunks)

    async def save(self, request: SaveRequest) -> SaveResult:
        """Write checkpoint iter_{step} under save_dir (atomic); returns its path.

        With --async-save the files are written in the background and the checkpoint is complete
        (renamed into place, named by the tracker) once finalised: before the next save, the next
        weight update, at shutdown, or before this call returns when `request.finalize` asks.
        --no-save-optim leaves the optimizer state out.
        """
        actor = self._require_init()
        algorithm = self._algorithm
        assert algorithm is not None

        def work() -> SaveResult:
            from tether.train.checkpoint import async_save as checkpoint_async
            from tether.train.checkpoint import load_save as checkpoint

            self._finalize_save()
            state = checkpoint.RunState(
                step=request.step,
                rollout_id=request.rollout_id,
                weight_version=request.weight_version,
                data_position=request.data_position,
            )
            save_optim = not algorithm.no_save_optim
            if not algorithm.async_save:
                return SaveResult(
                    path=str(checkpoint.save(actor, request.save_dir, state, save_optim=save_optim))
                )
            if self._async_saver is None:
                self._async_saver = checkpoint_async.AsyncCheckpointer()
            self._pending_save = self._async_saver.start_save(
                actor, request.save_dir, state, save_optim=save_optim
            )
            if request.finalize:
                return SaveResult(path=str(self._finalize_save()))
            return SaveResult(path=str(self._pending_save.final))

        return await self._run(work)

    def _finalize_save(self) -> Any:
        """Complete the --async-save checkpoint in flight, if any (collective; on the work
        thread); returns its path."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return None
        assert self._async_saver is not None  # it made `pending`
        return self._async_saver.finalize(pending)

    async def load(self, request: LoadRequest) -> LoadedState | None:
        """Resume from the newest loadable complete checkpoint in load_dir, or None if none.

        Returns its run state, its `path`, and the damaged checkpoints `skipped` on the way
        (newest first) so that the head can say which one it resumed from. A checkpoint without
        tether's digests loads only when load_dir is what --load or --ref-load names (the user
        named it), not the --save directory --auto-resume scans. `finetune` and `hf` load weights
        only (a checkpoint's, an HF directory's): the state then says rollout_id -1.
        """
        actor = self._require_init()
        load_dir = request.load_dir
        algorithm = self._algorithm
        assert algorithm is not None
        chosen = [algorithm.load, algorithm.ref_load]
        named = any(c is not None and Path(load_dir) == Path(c) for c in chosen)
        if request.hf:
            return await self._run(lambda: self._load_hf(load_dir))

        def work() -> LoadedState | None:
            from tether.train.checkpoint import load_save as checkpoint
            from tether.train.checkpoint.layout import holds_megatron_checkpoint, select_checkpoint_step

            where: str | Path = load_dir
            # iter_N exactly (--ckpt-step / --ref-ckpt-step), named by the user; a directory that
            # holds no checkpoint at all still answers "none" (slime then starts from --ref-load).
            if request.ckpt_step and holds_megatron_checkpoint(Path(load_dir)):
                where = select_checkpoint_step(load_dir, request.ckpt_step, flag=request.ckpt_step_flag)
            loaded = checkpoint.load_checkpoint(
                actor,
                where,
                finetune=request.finetune,
                named=named or where != load_dir,
                load_optim=not algorithm.no_load_optim,
                load_rng=not algorithm.no_load_rng,
            )
            if loaded is None:
                return None
            self._restart_old_actor()
            state = loaded.state
            return LoadedState(
                step=state.step,
                rollout_id=state.rollout_id,
                weight_version=state.weight_version,
                data_position=state.data_position,
                path=loaded.path,
                skipped=[DamagedCheckpoint(s.path, s.error) for s in loaded.skipped],
            )

        return await self._run(work)

    def _load_hf(self, hf_dir: str) -> LoadedState:
        """The actor's weights from a Hugging Face directory (--load naming one): a fresh run."""
        from tether.train.checkpoint import load_save as checkpoint
        from tether.train.model import build as model

        actor = self._require_init()
        chunks = [model.unwrap(c) for c in actor.chunks]
        model.load_hf_weights(chunks, actor.arch, hf_dir, self._topo, actor.weights)
        checkpoint.reload_main_params(actor)
        self._restart_old_actor()
        fresh = checkpoint.fresh_state()
        return LoadedState(
            step=fresh.step, rollout_id=fresh.rollout_id, weight_version=0, data_position={}, path=hf_dir
        )

    async def export_hf(self, request: ExportRequest) -> ExportResult:
        """Write the actor as an HF checkpoint directory (rank 0 writes; returns the path there)."""
        actor = self._require_init()

        def work() -> ExportResult:
            from tether.train.checkpoint import export

            path = export.save_hf(
                actor.chunks,
                actor.arch,
                self._topo,
                request.out_dir,
                base_dir=self._hf_checkpoint,
                version=request.version,
            )
            return ExportResult(path=None if path is None else str(path))

        return await self._run(work)

    async def compare_hf(self, request: CompareHFRequest) -> CompareHFResult:
        """Whether the actor's weights are exactly those of an HF checkpoint; collective over all
        ranks (the export's TP gathers); each stage's sync source compares its own tensors."""
        actor = self._require_init()

        def work() -> CompareHFResult:
            from tether.train.checkpoint.hf_match import compare_with_hf

            return compare_with_hf(
                actor.chunks, actor.arch, request.hf_dir, compare=self._topo.is_sync_source
            )

        return await self._run(work, needs="weights")

    async def update_weights(self, request: UpdateWeightsRequest) -> WeightUpdateResult:
        """Publish the actor's weights as `version` to every engine; collective over all ranks.

        Every rank takes part in gathering the HF tensors (TP gathers, PP stages streamed to
        rank 0); rank 0 is the sync source and runs the transport the flags chose, keeping it
        (the update group, the delta baseline) across syncs. Returns the ledger entry on rank 0.
        """
        if self._pending_save is not None:  # --async-save: complete the checkpoint first
            await self._run(self._finalize_save)
        result = WeightUpdateResult(entry=await self._update_weights(request))
        if self._old_actor is not None:
            # --keep-old-actor: the engines serve the actor's weights now; slime's queue moves
            interval = request.weight_sync.update_weights_interval
            await self._run(lambda: self._advance_old_actor(interval))
        if self._offload_train:
            # The engines generate next and may take the device memory; `_run` brings it back.
            await self._run(self._offload, needs="none")
        return result

    async def offload(self) -> None:
        """--offload-train: the trainer leaves the device now (the head calls it before colocated
        engines take their memory back); nothing without the flag."""
        self._require_init()
        if self._offload_train:
            await self._run(self._offload, needs="none")

    def _offload(self) -> None:
        """Everything to host; only the weights when the rest is there already (after an export)."""
        from tether.train.model import build as model
        from tether.train.state.offload import drop_weights, offload_trainer

        if self._offloaded is not None:
            drop_weights(self._offloaded)
            return
        # A pending parameter all-gather lands first: the host copy is then the weights as an
        # export reads them, so an export of the onloaded weights changes none of their bytes.
        model.sync_params(self._actor.chunks)
        frozen = [m for m in (self._ref, self._teacher) if m is not None]
        # The reference's and the teacher's weights leave the device alike (only `.chunks` is read).
        others = None if not frozen else SimpleNamespace(chunks=[c for m in frozen for c in m.chunks])
        self._offloaded = offload_trainer(self._actor, others)

    async def _update_weights(self, request: UpdateWeightsRequest) -> LedgerEntry | None:
        actor = self._require_init()
        import torch

        from tether.sync.factory import is_distributed
        from tether.train.checkpoint import export

        # Every export below reads the actor's weights, on this thread or another (rank 0's
        # transport, a stage source's): an offloaded trainer brings them back first.
        await self._run(lambda: None, needs="weights")
        if request.colocate:
            return await self._update_weights_colocated(request)
        version, engine_urls, weight_sync = request.version, request.engine_urls, request.weight_sync
        colocate, engine_ranks = request.colocate, request.engine_ranks
        master_address, master_port = request.master_address, request.master_port
        engines_restarted = request.engines_restarted
        if self._topo.pp_size > 1 and is_distributed(weight_sync, colocate):
            return await self._update_weights_by_stage(
                version,
                engine_urls,
                weight_sync,
                engine_ranks,
                master_address,
                master_port,
                engines_restarted,
            )
        # Broadcasts over NCCL and CUDA IPC handles take the tensors where they were gathered;
        # files, gloo and shared memory take them in host memory.
        on_device = torch.cuda.is_available() and (colocate or is_distributed(weight_sync, colocate))
        stream = export.stream_to_rank0(
            actor.chunks, actor.arch, self._topo, None, None if on_device else export.CPU
        )
        if self._topo.rank != 0:
            await self._run(lambda: _drain(stream))
            return None
        if self._transport is not None and self._engine_urls != engine_urls:
            await self._drop_transport()  # an engine left or rejoined with its node: the new set
        if self._transport is None:
            from tether.sync.factory import engine_clients, make_transport, sync_device

            self._engine_urls = list(engine_urls)
            self._engines = engine_clients(engine_urls, weight_sync.update_weight_request_timeout)
            self._transport = make_transport(
                weight_sync,
                self._engines,
                hf_checkpoint=self._hf_checkpoint,
                colocate=colocate,
                engine_ranks=engine_ranks or [1] * len(engine_urls),
                master_address=master_address,
                master_port=master_port,
                # Built here, on the event loop's thread, whose current GPU is not this rank's.
                device=sync_device(self._topo.local_rank),
            )
        if engines_restarted and hasattr(self._transport, "mark_engine_restarted"):
            self._transport.mark_engine_restarted()  # rebuild the update group with the new process
        self._busy = True
        try:
            entry = await self._transport.sync(version, stream)
        finally:
            self._busy = False
            # After a failure the rest still flows, so the ranks feeding the stream (TP peers'
            # gathers, later stages' sends) finish too instead of blocking until their timeout.
            await self._run(lambda: _drain(stream))
        return entry

    async def _update_weights_colocated(self, request: UpdateWeightsRequest) -> LedgerEntry | None:
        """--colocate: every rank shares its own device's copy of each bucket; rank 0 gathers the
        handles and posts each engine TP rank the one from its own device's rank
        (`request.handle_sources`), as tether.sync.transports.tensor describes."""
        import torch
        import torch.distributed as dist

        from tether.sync.transports.tensor import HandleBucket, rank_handle_buckets
        from tether.train.checkpoint import export

        actor, topo = self._require_init(), self._topo
        ranks = request.engine_ranks or [1] * len(request.engine_urls)
        sources = request.handle_sources or [[0] * n for n in ranks]

        def gather(mine: list[str]) -> list[list[str]] | None:
            box: list[Any] | None = [None] * dist.get_world_size() if topo.rank == 0 else None
            dist.gather_object(mine, box, dst=0)  # NCCL: staged on this thread's GPU, the rank's
            return box

        def barrier() -> None:
            if dist.get_backend() == "nccl":  # named, not guessed from the rank number
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()

        device = None if torch.cuda.is_available() else export.CPU  # CUDA IPC takes them in place
        # Under PP > 1 every stage's tensors reach every rank: an engine rank takes the whole
        # model from the trainer rank on its own device.
        every = export.iter_every_stage if topo.pp_size > 1 else export.iter_hf_weights
        steps = rank_handle_buckets(
            every(actor.chunks, actor.arch, device=device),
            request.weight_sync.update_weight_buffer_size,
            rank=topo.rank,
            sources=sources,
            gather=gather,
            barrier=barrier,
        )
        if topo.rank != 0:
            await self._run(lambda: _drain(steps), needs="weights")
            return None
        if self._transport is None:
            from tether.sync.factory import engine_clients, make_transport

            self._engines = engine_clients(
                request.engine_urls, request.weight_sync.update_weight_request_timeout
            )
            self._transport = make_transport(
                request.weight_sync,
                self._engines,
                hf_checkpoint=self._hf_checkpoint,
                colocate=True,
                engine_ranks=ranks,
                master_address=request.master_address,
                master_port=request.master_port,
            )

        async def buckets() -> Any:
            while True:
                bucket: HandleBucket | None = await self._run(lambda: next(steps, None), needs="weights")
                if bucket is None:
                    return
                yield bucket

        self._busy = True
        try:
            entry: LedgerEntry = await self._transport.sync_buckets(request.version, buckets())
        finally:
            self._busy = False
        return entry

    async def _update_weights_by_stage(
        self,
        version: int,
        engine_urls: list[str],
        weight_sync: WeightSyncConfig,
        engine_ranks: list[int] | None,
        master_address: str,
        master_port: int,
        engines_restarted: bool,
    ) -> LedgerEntry | None:
        """PP > 1 over the distributed transport: each stage's sync source (TP 0, DP 0)
        broadcasts its own stage's tensors over its own group with the engines, as slime does;
        stage 0's source controls the engines. The other ranks take part in their stage's TP
        gathers and in the all-reduces that keep the stages in step."""

        from tether.sync.factory import engine_clients, sync_device, weight_group_backend
        from tether.sync.transports.distributed import DistributedTransport
        from tether.train.checkpoint import export
        from tether.train.parallel import topology as parallel

        actor, topo = self._require_init(), self._topo
        stream = export.iter_hf_weights(actor.chunks, actor.arch, device=None)  # the transport moves them
        if not topo.is_sync_source:

            def follow() -> None:
                if parallel.all_true(True):  # every stage opened its part
                    for stage in range(topo.pp_size):  # the stages send in turn (sync_stage)
                        if stage == topo.pp_rank:
                            _drain(stream)
                        parallel.all_true(True)

            await self._run(follow)
            return None
        if self._transport is not None and self._engine_urls != engine_urls:
            # Engines joined, left or were drained: every stage's source gets the same request and
            # builds its group afresh for the engines of the moment.
            await self._drop_transport()
        if self._transport is None:
            self._engine_urls = list(engine_urls)
            self._engines = engine_clients(engine_urls, weight_sync.update_weight_request_timeout)
            first = topo.pp_rank == 0
            self._transport = DistributedTransport(
                self._engines,
                weight_sync,
                # Stage 0 uses the plan's group port; later stages listen on a free port of
                # their own node, which they tell the engines when the group is built.
                master_address=master_address if first else self._node_address or master_address,
                master_port=master_port if first else 0,
                engine_ranks=engine_ranks or [1] * len(engine_urls),
                backend=weight_group_backend(),
                control_engines=first,
                group_tag=f"pp{topo.pp_rank}-",
                # This stage source's own GPU: built on the event loop's thread, whose current
                # GPU is 0, not the one the rank chose on its worker thread.
                device=sync_device(topo.local_rank),
            )
        if engines_restarted:
            self._transport.mark_engine_restarted()

        async def agree(ok: bool) -> bool:
            return await self._run(lambda: parallel.all_true(ok))

        self._busy = True
        try:
            entry = await self._transport.sync_stage(version, stream, agree, (topo.pp_rank, topo.pp_size))
        finally:
            self._busy = False
        return entry

    async def health(self) -> WorkerInfo:
        """Answered from the event loop, even while a step runs on the worker thread."""
        return self._info()

    async def _drop_transport(self) -> None:
        """Close the weight-sync transport and its engine clients; the next sync builds them
        for the engines it is given."""
        transport, self._transport = self._transport, None
        if hasattr(transport, "close"):
            await transport.close()
        for client in self._engines:
            await client.close()
        self._engines = []

    async def shutdown(self) -> None:
        """Stop serving; the process then leaves its process groups and exits 0.

        An --async-save checkpoint still being written is completed first (its failure is
        raised to the caller once the rest is closed). The weight-sync transport goes next: a
        weight-update group still open at exit can abort the process (gloo), and the engines are
        told to drop their side of it.
        """
        transport, self._transport = self._transport, None
        try:
            try:
                if self._pending_save is not None:
                    await self._run(self._finalize_save)
                profiler, self._profiler = self._profiler, None
                if profiler is not None:  # an open trace window is written; a memray capture closed
                    await self._run(profiler.close, needs="none")
            finally:
                if transport is not None and hasattr(transport, "close"):
                    await transport.close()
        finally:
            for client in self._engines:
                await client.close()
            self._stop.set()

    async def _wait_stopped(self) -> None:
        await self._stop.wait()


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


async def serve(
    address_dir: Path,
    bind_host: str,
    ipc_dir: Path | None = None,
    node_address: str = "",
    job: str = "trainer",
) -> None:
    """Serve this rank's RPC until `shutdown` is called: on a Unix socket under `ipc_dir` when
    given (the head is on this node) and its path fits, else on TCP at `bind_host`. `job` names
    the rank (`{job}-rank{RANK}`): "critic" for the PPO critic's job beside the actor's."""
    from tether.runtime.rpc.actors import RpcServer
    from tether.runtime.rpc.endpoints import ipc_endpoint
    from tether.runtime.rpc.secret import secret_from_env

    secret = secret_from_env()
    rank = int(os.environ.get("RANK", "0"))
    endpoint = None
    if ipc_dir is not None:
        endpoint = ipc_endpoint(ipc_dir, f"{job}-rank{rank}")  # main() made the directory
    # Leaving the executor waits for the step on its thread; the head bounds that wait (it
    # signals a rank that has not exited within its grace period).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{job}-rank{rank}") as executor:
        worker = TrainerWorker(executor, node_address)
        bind = endpoint or f"tcp://{bind_host}:0"
        async with RpcServer(worker, bind, secret, name=f"{job}-rank{rank}") as server:
            write_address(address_dir, rank, server.address)
            await worker._wait_stopped()
    from tether.train.parallel import topology as parallel

    try:
        parallel.destroy()
    except Exception as exc:  # the job is ending; a peer may already be gone
        print(f"trainer rank {rank}: leaving the process groups: {exc}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rpc-address-dir",
        required=True,
        type=Path,
        help="Directory where each rank writes rank_NNNNN.json.",
    )
    parser.add_argument("--bind-host", default="127.0.0.1", help="Interface the rank's RPC server binds.")
    parser.add_argument(
        "--node-address",
        default="",
        help="This node's address toward the engines (weight-sync groups of later pipeline stages).",
    )
    parser.add_argument(
        "--ipc-dir",
        type=Path,
        default=None,
        help="Serve on a Unix socket in this directory (ranks on the head's node; faster than TCP).",
    )
    parser.add_argument(
        "--job",
        default="trainer",
        choices=["trainer", "critic"],
        help="The job's name in the rank's RPC and socket names: trainer (the actor) or critic (PPO).",
    )


def main(args: argparse.Namespace) -> int:
    import uvloop

    from tether.runtime.process.shim import die_with_parent

    die_with_parent()  # the rank ends with its torchrun agent, however that one ends

    from tether.runtime.process.deferred_package import defer_transformers_models
    from tether.runtime.process.gc_tuning import imports_without_gc
    from tether.train.model.megatron_cpu import lean_megatron_imports

    # Once, quietly, before any rank work; without the Dynamo/Inductor, wandb and TensorBoard
    # imports Megatron's own import makes and a rank never uses (~2.5 s of each rank's start).
    with imports_without_gc():
        defer_transformers_models()  # a rank reads its own model's config only
        with lean_megatron_imports():
            import megatron.core  # noqa: F401
    if args.ipc_dir is not None:
        args.ipc_dir.mkdir(parents=True, exist_ok=True)
    uvloop.run(serve(args.rpc_address_dir, args.bind_host, args.ipc_dir, args.node_address, args.job))
    return 0


if __name__ == "__main__":
    # torchrun copies the first failed rank's error file (its exception and traceback, written
    # by `record`) into the job's TORCHELASTIC_ERROR_FILE.
    from torch.distributed.elastic.multiprocessing.errors import record

    _parser = argparse.ArgumentParser(prog="python -m tether.train.rank.worker", description=__doc__)
    add_arguments(_parser)
    _rc = record(main)(_parser.parse_args()) or 0
    # `serve` has closed all this rank holds (RPC server, weight-sync group, process groups);
    # the interpreter's own teardown of torch and Megatron only adds seconds to every run's end
    # (and on GPUs can block in driver teardown). A rank that raised never gets here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_rc)

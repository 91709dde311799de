"""The trainer ranks of a run: torchrun per actor node, one RPC handle per rank.

The pool only hands things over: one train-side call (`tether.train.rank.work`) turns each
rollout into every step's per-DP-rank requests, and the pool sends them through the typed
head ↔ rank protocol (`tether.train.rank.protocol.RankClient`), calling every rank with the same
method in the same order, as Megatron's collectives require; ranks of one data-parallel group
receive the same request.

Leaving the pool (every exit path of the run) asks each rank to exit (`shutdown`): the ranks
leave their process groups and exit 0, so torchrun exits 0 and leaves no error file in
`logs/`. Only a job still running SHUTDOWN_GRACE seconds later is stopped by signal. Each
torchrun job's error file is `logs/trainer-node<R>-error.json`, which therefore exists only
after a real failure: a rank that raised leaves its exception and traceback there (a rank
killed by a signal leaves none; torchrun's log names it), and a job stopped by signal records
that signal there.

A node of the job lost mid-run (its agent gone past the heartbeat tolerance) ends the job at
once: a rank call that fails while such a node stops answering raises TrainerNodeLost, and
leaving the pool then stops the surviving ranks by signal after LOST_NODE_GRACE, since asking
them would wait on a collective with a lost peer (tether.run.nodes.trainer_loss).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tether.config import Config
from tether.placement.colocation import handle_sources
from tether.placement.plan import Plan, TorchrunNode
from tether.records.run_dir import RunDir
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV
from tether.rollout.sample import Sample
from tether.run.ci_checks import THRESHOLD_DEFAULT, CiChecks, CiOptions
from tether.run.nodes.trainer_loss import TrainerNodeLost, confirm_lost_node, lost_node
from tether.run.process_threads import one_torch_thread_if_imported
from tether.run.train_data_hooks import load_train_data_hooks
from tether.runtime.errors import ActorDied, ConfigError
from tether.runtime.process.gc_tuning import imports_without_gc
from tether.runtime.process.spec import ProcessSpec
from tether.runtime.process.supervisor import CHEAP_READY_POLL_MAX, LOCAL, ManagedProcess, Supervisor
from tether.runtime.rpc.actors import connect
from tether.sync.ledger import LedgerEntry
from tether.train.checkpoint.layout import critic_checkpoint_dir
from tether.train.megatron_roles import role_config
from tether.train.rank.addresses import read_addresses

# The rank protocol (and numpy, which its arrays need) is imported where a request is made: the
# head starts its processes before that import (~60 ms), and its step work imports it anyway.
if TYPE_CHECKING:
    import numpy as np

    from tether.train.rank.protocol import (
        LoadedState,
        LogProbsRequest,
        LogProbsResult,
        RankClient,
        TrainRequest,
        TrainResult,
        TrainRole,
        ValuesRequest,
        ValuesResult,
        WorkerInfo,
    )
    from tether.train.rank.rollout_calls import Calls, Results, Trained
    from tether.train.rank.work import WorkOptions

log = logging.getLogger(__name__)
Q = TypeVar("Q")
R = TypeVar("R")

Groups = list[list[Sample]]
RPC_TIMEOUT = 3600.0  # a train step or a checkpoint of a large model can take long; never forever
# When a rank dies, torchrun stops the others (SIGTERM, SIGKILL after its 30 s shutdown timeout)
# and exits non-zero; its exit report (code, log tail naming the failed rank) is worth that wait.
EXIT_REPORT_TIMEOUT = 45.0
# After `shutdown` a rank finishes the work on its thread, closes its weight-sync group and
# leaves its process groups; a job not gone by then is stopped by signal.
SHUTDOWN_GRACE = 60.0
# After a node of the job was lost: the step cannot finish and nothing is left to save, so the
# surviving ranks get SIGTERM and, this much later, SIGKILL.
LOST_NODE_GRACE = 5.0
# The head's step work (advantages, batching) is imported while the ranks start
# (`import_step_work`), not before the run starts them; torch (~1 s of CPU, which the ranks' own
# start needs on a small machine) only where that work uses it (`step_work_needs_torch`).
STEP_WORK_MODULES = ("tether.train.rank.rollout_calls",)


def step_work_needs_torch(cfg: Config) -> bool:
    """Whether the head's step work uses torch in this run: grpo, gspo and cispo without KL
    shaping, whitening, on-policy distillation or train-data hooks put each reward on its tokens
    in numpy (`tether.train.algorithms.advantages.needs_torch`); everything else computes in torch.
    Any train-data hook counts (most hand torch tensors to the hook), so this warms torch for a
    reward post-process hook too, whose own step work stays in numpy (`tether.train.rank.work`)."""
    from tether.train.algorithms.advantages import needs_torch

    algorithm = cfg.algorithm
    hooks = (
        algorithm.custom_reward_post_process_path,
        algorithm.custom_advantage_function_path,
        algorithm.custom_convert_samples_to_train_data_path,
        algorithm.rollout_data_postprocess_path,
    )
    return needs_torch(algorithm) or any(path is not None for path in hooks)


def import_step_work(with_torch: bool = True) -> None:
    """Import the head's step-work modules (and torch, `with_torch`); the run does it on a thread
    at start."""
    with imports_without_gc():
        for name in (*STEP_WORK_MODULES, *(("torch",) if with_torch else ())):
            importlib.import_module(name)


def _first(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first rank's error: what the caller (and the user) needs, not the task-group wrapper."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, Exception)
    return exc


async def _ask_to_exit(rank: RankClient) -> None:
    """`shutdown` on one rank; a connection dropped before the answer means it is exiting."""
    try:
        await rank.shutdown(timeout=SHUTDOWN_GRACE)
    except ActorDied:
        pass
    except Exception as exc:  # this rank gets the signal after the grace period instead
        log.warning("asking %s to exit failed: %s", rank.name, exc)


class TrainerPool:
    """Starts the actor's torchrun job(s), connects to every rank, and drives them in lock-step."""

    def __init__(
        self,
        sup: Supervisor,
        plan: Plan,
        cfg: Config,
        run_dir: RunDir,
        secret: bytes,
        names: dict[int, str],
        *,
        engine_key: str | None = None,
        role: TrainRole = "actor",
        critic: TrainerPool | None = None,
    ) -> None:
        """`engine_key`: the key engines require; rank 0 (the weight sync source) sends it.
        `role` "critic": this pool drives the plan's critic group (PPO); the actor's pool gets it
        as `critic` and runs it before each of its own rollouts (`train`)."""
        self.role = role
        self.critic = critic
        self.names = names
        self.engine_key = engine_key
        self.sup = sup
        self.plan = plan
        self.cfg = role_config(cfg, role)  # --megatron-config-path: this role's trainer flags
        self.run_dir = run_dir
        self.secret = secret
        self.address_dir = run_dir.path / ("trainer" if role == "actor" else role)
        self.ranks: list[RankClient] = []
        self.procs: list[ManagedProcess] = []
        self.infos: list[WorkerInfo] = []
        self.world_size = 0
        self.steps_done = 0
        # slime's train-data hooks (custom reward post-processing, advantages): loaded once, run here
        self._train_data_hooks = load_train_data_hooks(self.cfg)
        self.checks = ci_checks(cfg)

    # ----- start and stop -----
    def _spec(self, node: TorchrunNode) -> ProcessSpec:
        argv = [
            sys.executable,
            "-m",
            "tether.train.rank.torchrun",  # torchrun, its rendezvous store on the node's address alone
            *node.torchrun_args(),
            "-m",
            "tether.train.rank.worker",
            "--rpc-address-dir",
            str(self.address_dir),
            "--job",
            self._job_prefix,  # the ranks' RPC and socket names
        ]
        address = next(n.address for n in self.plan.nodes if n.index == node.node)
        argv += ["--node-address", address]
        if self.names[node.node] == LOCAL:
            argv += ["--ipc-dir", str(self.run_dir.path / "sock")]  # same node as the head
        else:
            argv += ["--bind-host", address]  # the node's address toward the head
        env = {
            **node.env,
            "OMP_NUM_THREADS": "1",
            **self.cfg.run.train_env_vars,  # slime's --train-env-vars: the user's, over tether's defaults
            "TORCHELASTIC_ERROR_FILE": str(self.error_file(node.node_rank)),
        }
        if self.engine_key is not None:
            env[ENGINE_KEY_ENV] = self.engine_key  # read by sync.factory.engine_clients
        return ProcessSpec(
            name=f"{self._job_prefix}-node{node.node_rank}",
            argv=argv,
            env=env,
            node=self.names[node.node],
            address=address,
        )

    def error_file(self, node_rank: int) -> Path:
        """Where torchrun of node `node_rank` writes the first failed rank's error, and only then.

        One file per node: a node stopped by signal because another failed must not overwrite
        the report of the one that failed.
        """
        return self.run_dir.logs / f"{self._job_prefix}-node{node_rank}-error.json"

    @property
    def _critic_shares_devices(self) -> bool:
        critic = self.plan.train_group("critic")
        return critic is not None and critic.shares_devices_with == "actor"

    @property
    def _job_prefix(self) -> str:
        """The torchrun jobs' name: `trainer` for the actor's, `critic` for the critic's."""
        return "trainer" if self.role == "actor" else self.role

    async def __aenter__(self) -> TrainerPool:
        group = self.plan.train_group(self.role)
        if group is None:
            raise RuntimeError(f"the placement plan has no {self.role} group to start")
        hf_checkpoint = self.cfg.rollout.hf_checkpoint
        if hf_checkpoint is None:  # before any rank starts: each would fail to build its model
            raise ConfigError("--hf-checkpoint", None, "the trainer ranks build the model from it")
        if self.plan.colocate and self.role == "actor":
            handle_sources(self.plan)  # an engine device without an actor rank is refused now
        world = self.world_size = group.world_size
        # A run directory used again (requeued job, restarted service) still holds the last
        # start's rank addresses; only the ranks started now may be read.
        for stale in self.address_dir.glob("rank_*.json"):
            stale.unlink(missing_ok=True)

        warm: list[asyncio.Task[None]] = []

        async def all_ranks_serving() -> bool:
            # First asked once torchrun runs: the head's step-work imports (torch among them
            # where that work uses it) overlap the ranks' start from then on instead of delaying it.
            if not warm:
                uses_torch = step_work_needs_torch(self.cfg)  # numpy's import: after the spawn
                warm.append(tg.create_task(asyncio.to_thread(import_step_work, uses_torch)))
            return read_addresses(self.address_dir, world) is not None

        started = time.monotonic()
        starts: list[asyncio.Task[ManagedProcess]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                starts = [
                    tg.create_task(
                        self.sup.start(
                            self._spec(n),
                            ready=all_ranks_serving,
                            ready_timeout=600.0,
                            ready_poll_max=CHEAP_READY_POLL_MAX,  # file lookups: see there
                        )
                    )
                    for n in group.nodes
                ]
            self.procs = [t.result() for t in starts]
            from tether.train.rank.protocol import InitRequest, RankClient

            # On the loop's thread, where the step work runs (torch imported by now where it uses it).
            one_torch_thread_if_imported()
            addresses = read_addresses(self.address_dir, world)
            assert addresses is not None
            for r in range(world):
                name = f"{self._job_prefix}-rank{r}"
                handle = await connect(addresses[r], self.secret, name=name, timeout=60.0)
                self.ranks.append(RankClient(handle, timeout=RPC_TIMEOUT))
            cfg = self.cfg
            init = InitRequest(
                hf_checkpoint=hf_checkpoint,
                algorithm=cfg.algorithm,
                megatron=cfg.megatron,
                temperature=cfg.rollout.rollout_temperature,
                # --colocate implies the offload, and so does a critic on the actor's devices (slime:
                # ppo sets offload_train); on CPU devices there is no device memory to free.
                offload_train=(self.plan.offload_train or self._critic_shares_devices)
                and cfg.cluster.cpu_devices is None,
                role=self.role,
                profile=cfg.profile,  # traces and default memory snapshots: the run directory's profile/
                profile_dir=str(self.run_dir.path / "profile"),
            )
            infos = await self._all(lambda rank: rank.init(init))
        except BaseException:
            # The exit stack calls __aexit__ only once __aenter__ has returned: stop here what
            # did start (a job that failed to start is already gone).
            self.procs = [t.result() for t in starts if t.done() and not t.cancelled() and not t.exception()]
            await self.__aexit__()
            raise
        self.infos = infos
        self.run_dir.event(
            "trainer_ready" if self.role == "actor" else f"{self.role}_ready",
            world_size=world,
            seconds=time.monotonic() - started,
            dp_size=infos[0].dp_size,
            tp_size=infos[0].tp_size,
            pp_size=infos[0].pp_size,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._stop_ranks()
        finally:
            for rank in self.ranks:
                await rank.close()

    async def _stop_ranks(self) -> None:
        """Ask every rank to exit; the supervisor signals a job still running after SHUTDOWN_GRACE.

        Without a connection to every rank (start-up failed half way) asking cannot reach them
        all, so the jobs are stopped by signal at once.
        """
        if not self.procs:
            return
        names = [p.name for p in self.procs]
        lost = self.lost_node() is not None
        if lost or len(self.ranks) < self.world_size:
            async with asyncio.TaskGroup() as tg:
                for name in names:
                    tg.create_task(self.sup.stop(name, LOST_NODE_GRACE if lost else None))
            return

        async def ask_all() -> None:
            async with asyncio.TaskGroup() as tg:
                for rank in self.ranks:
                    tg.create_task(_ask_to_exit(rank))

        await self.sup.stop_gracefully(names, ask_all, timeout=SHUTDOWN_GRACE)

    def lost_node(self) -> TrainerNodeLost | None:
        """A node of this pool's torchrun jobs that the supervisor counts lost now, or None."""
        return lost_node(self.sup, self.procs)

    async def _all(self, call: Callable[[RankClient], Coroutine[Any, Any, R]]) -> list[R]:
        """The same call on every rank, concurrently; results in rank order."""
        return await self._gather([call(rank) for rank in self.ranks])

    async def _per_dp(
        self, call: Callable[[RankClient, Q], Coroutine[Any, Any, R]], requests: Sequence[Q]
    ) -> list[R]:
        """Each rank gets the request of its data-parallel rank (`requests[dp_rank]`); results
        in rank order."""
        ranks = zip(self.ranks, self.infos, strict=True)
        return await self._gather([call(rank, requests[info.dp_rank]) for rank, info in ranks])

    def _first_per_dp(self, results: Sequence[R]) -> list[R]:
        """One result per data-parallel rank (index: dp_rank): its first rank's, in rank order."""
        by_dp: dict[int, R] = {}
        for info, result in zip(self.infos, results, strict=True):
            by_dp.setdefault(info.dp_rank, result)
        return [by_dp[d] for d in range(len(by_dp))]

    async def _gather(self, calls: list[Coroutine[Any, Any, R]]) -> list[R]:
        """Run every rank's call concurrently; the first rank's error, as the user needs it."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(call) for call in calls]
        except* Exception as group:
            # A rank whose peer's node went sees only a broken collective (or none of its own):
            # the lost node is what ended the step.
            lost = await confirm_lost_node(self.sup, self.procs)
            if lost is not None:
                raise lost from group
            first = _first(group)
            if isinstance(first, ActorDied):
                raise await self._exit_report(first) from group
            raise first from group
        return [t.result() for t in tasks]

    async def _exit_report(self, lost: ActorDied) -> ActorDied:
        """A rank's connection dropped: wait for its torchrun job to end and report that.

        The connection is lost at once while torchrun still stops the other ranks; its exit
        (code, and a log tail that names the failed rank) says what happened, the lost
        connection alone does not.
        """
        pending = [p.exit for p in self.procs]
        if not pending:
            return lost
        done, _ = await asyncio.wait(
            pending, timeout=EXIT_REPORT_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            return lost
        info = next(f for f in pending if f.done()).result()
        first = f"{lost.name}: {lost.reason}" if lost.reason else lost.name
        return ActorDied(
            info.name,
            returncode=info.returncode,
            signal=info.signal,
            log_tail=info.log_tail,
            reason=f"{info.reason}; {first}" if info.reason else first,
        )

    @property
    def dp_size(self) -> int:
        return self.infos[0].dp_size

    # ----- training -----
    async def train(self, rollout_id: int, groups: Groups, *, weight_version: int) -> dict[str, float]:
        """Train on one rollout (one or more optimizer steps); the last step's metrics.

        With a critic (ppo), as slime's train loop: the critic's values and steps first, then the
        actor's steps on GAE advantages from those values, except in the first
        --num-critic-only-steps rollouts, which train the critic only."""
        from tether.train.rank.rollout_calls import StepMetricOptions, actor_calls

        values: np.ndarray | None = None
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:
            values, critic_metrics = await self.critic.train_critic(rollout_id, groups)
            if rollout_id < self.cfg.algorithm.num_critic_only_steps:
                return {**critic_metrics, "train/weight_version": float(weight_version)}
        rollout = self.cfg.rollout
        correct_len = rollout.rollout_max_response_len if rollout.log_correct_samples else None
        trained = await self._dispatch(
            actor_calls(
                groups,
                rollout_id,
                self.cfg.algorithm,
                self._work_options(),
                dp_size=self.dp_size,
                hooks=self._train_data_hooks,
                values=values,
                metric_options=StepMetricOptions(
                    per_token_loss=self.cfg.megatron.calculate_per_token_loss,
                    correct_samples_max_len=correct_len,
                ),
                checks=self.checks,
            )
        )
        if self.cfg.debug.save_debug_train_data is not None:  # what the ranks trained on, now in the weights
            from tether.run.train_dump import save_train_data

            await asyncio.to_thread(
                save_train_data, self.cfg.debug.save_debug_train_data, rollout_id, trained.shards
            )
        return {**trained.metrics, **critic_metrics, "train/weight_version": float(weight_version)}

    async def train_critic(self, rollout_id: int, groups: Groups) -> tuple[np.ndarray, dict[str, float]]:
        """The critic pool's part of a rollout: its values of every response token (its weights
        before the rollout), then its value-loss steps. Returns the values in sample order (the
        actor's GAE baseline) and the last step's metrics under slime's names (train/critic-*)."""
        from tether.train.rank.rollout_calls import critic_calls

        trained = await self._dispatch(
            critic_calls(
                groups,
                rollout_id,
                self.cfg.algorithm,
                self._work_options(),
                dp_size=self.dp_size,
                hooks=self._train_data_hooks,
                checks=self.checks,
            )
        )
        assert trained.values is not None
        return trained.values, trained.metrics

    def _work_options(self) -> WorkOptions:
        from tether.train.rank.work import WorkOptions

        arch = None
        if self.cfg.data.balance_by_flops:  # the FLOPs estimate needs the model's shape
            from tether.train.model.hf_config import load_arch

            assert self.cfg.rollout.hf_checkpoint is not None  # refused before the ranks start
            arch = load_arch(self.cfg.rollout.hf_checkpoint)
        return WorkOptions.from_config(self.cfg.data, self.cfg.rollout.reward_key, arch)

    async def _dispatch(self, calls: Calls) -> Trained:
        """Run a rollout's calls (train/rank/rollout_calls.py) on the ranks, one collective call
        at a time, each answered by one result per DP rank; what the rollout trained."""
        from tether.train.rank.rollout_calls import LogProbsCall, TrainCall, ValuesCall

        results: Results | None = None
        while True:
            one_torch_thread_if_imported()  # a hook may have imported it since
            try:
                call = calls.send(results)  # type: ignore[arg-type]  # None starts the generator
            except StopIteration as done:
                trained: Trained = done.value
                return trained
            match call:
                case LogProbsCall(requests):
                    results = self._first_per_dp(await self._per_dp(_log_probs, requests))
                case TrainCall(requests):
                    results = self._first_per_dp(await self._per_dp(_train, requests))
                    self.steps_done += 1
                case ValuesCall(requests):
                    results = self._first_per_dp(await self._per_dp(_values, requests))

    # ----- weights and checkpoints -----
    async def update_weights(
        self,
        version: int,
        engine_urls: list[str],
        *,
        engines_restarted: bool = False,
        engine_sizes: list[int] | None = None,
    ) -> LedgerEntry:
        """Publish the weights as `version`; the ledger entry of the rank that drove the engines.
        `engine_sizes`: each engine's ranks in the update group, for `engine_urls` in order (the
        engines of the moment: one lost, joined or drained changes them); by default the plan's."""
        from tether.train.rank.protocol import UpdateWeightsRequest

        layout = self.plan.weight_sync
        request = UpdateWeightsRequest(
            version=version,
            engine_urls=engine_urls,
            weight_sync=self.cfg.weight_sync,
            colocate=self.plan.colocate,
            engines_restarted=engines_restarted,
        )
        if layout is not None:
            request.engine_ranks = engine_sizes or [e.size for e in layout.engines]
            request.master_address = layout.master_addr
            request.master_port = layout.master_port
        if self.plan.colocate:
            request.handle_sources = handle_sources(self.plan)
        results = await self._all(lambda rank: rank.update_weights(request))
        entry = next((r.entry for r in results if r.entry is not None), None)
        if entry is None:
            raise RuntimeError(f"weight sync v{version}: no trainer rank reported its ledger entry")
        return entry

    async def offload(self) -> None:
        """--offload-train: every rank's device memory to host now (the ranks do nothing without
        the flag); whatever the ranks are asked next brings back what it needs."""
        await self._all(lambda rank: rank.offload())

    async def save(
        self, rollout_id: int, weight_version: int, position: dict[str, Any], *, finalize: bool = False
    ) -> Path:
        """Checkpoint of step `rollout_id`; `finalize`: with --async-save, return only once it
        is complete (otherwise the ranks complete it before the next save or weight update)."""
        assert self.cfg.algorithm.save is not None
        save_dir = self.cfg.algorithm.save
        if self.role == "critic":
            save_dir = str(critic_checkpoint_dir(save_dir))
        from tether.train.rank.protocol import SaveRequest

        request = SaveRequest(
            save_dir=save_dir,
            step=rollout_id,
            rollout_id=rollout_id,
            weight_version=weight_version,
            data_position=position,
            finalize=finalize,
        )
        results = await self._all(lambda rank: rank.save(request))
        if self.critic is not None:  # the critic's checkpoint of the same step, beside the actor's
            await self.critic.save(rollout_id, weight_version, position, finalize=finalize)
        return Path(results[0].path)

    async def load(
        self,
        load_dir: str,
        *,
        finetune: bool = False,
        hf: bool = False,
        ckpt_step: int | None = None,
        ckpt_step_flag: str = "--ckpt-step",
    ) -> LoadedState | None:
        """The run state of the checkpoint every rank loaded, or None when there was none.
        `finetune`/`hf`: weights only (from a checkpoint / an HF directory); `ckpt_step`: that
        iteration exactly (`ckpt_step_flag` asked for it), see LoadRequest."""
        from tether.train.rank.protocol import LoadRequest

        request = LoadRequest(
            load_dir=load_dir, finetune=finetune, hf=hf, ckpt_step=ckpt_step, ckpt_step_flag=ckpt_step_flag
        )
        states = await self._all(lambda rank: rank.load(request))
        state = states[0]
        if self.critic is not None and state is not None and not (finetune or hf):
            await self._load_critic(Path(state.path))
        return state

    async def hf_difference(self, hf_dir: str) -> str | None:
        """None when the actor holds exactly the weights of the HF checkpoint in `hf_dir` (every
        tensor it would sync, `tether.train.checkpoint.hf_match`); else the first difference."""
        from tether.train.rank.protocol import CompareHFRequest

        results = await self._all(lambda rank: rank.compare_hf(CompareHFRequest(hf_dir=hf_dir)))
        found = next((r.difference for r in results if r.difference is not None), None)
        if found is None and not any(r.compared for r in results):
            return "no rank compared a tensor"
        return found

    async def _load_critic(self, actor_checkpoint: Path) -> None:
        """The critic's checkpoint of the step the actor resumed from, when the run saved one;
        otherwise the critic keeps its start (--hf-checkpoint, a fresh value head), as slime's
        critic re-initialises a value head its checkpoint lacks."""
        assert self.critic is not None
        path = critic_checkpoint_dir(actor_checkpoint.parent) / actor_checkpoint.name
        if not path.is_dir():
            self.run_dir.event("critic_fresh", actor_checkpoint=str(actor_checkpoint), missing=str(path))
            log.warning("no critic checkpoint at %s: the critic starts from --hf-checkpoint", path)
            return
        from tether.train.rank.protocol import LoadRequest

        states = await self.critic._all(lambda rank: rank.load(LoadRequest(load_dir=str(path))))
        if states[0] is None:
            raise RuntimeError(f"the critic's checkpoint {path} could not be loaded")
        self.run_dir.event("critic_loaded", path=states[0].path)

    async def export_hf(self, out_dir: str) -> None:
        from tether.train.rank.protocol import ExportRequest

        request = ExportRequest(out_dir=out_dir)
        await self._all(lambda rank: rank.export_hf(request))


def ci_checks(cfg: Config) -> CiChecks | None:
    """The run's --ci-test / grad-norm checks, or None when no such flag is set."""
    debug = cfg.debug
    checks = CiChecks(
        CiOptions(
            ci_test=debug.ci_test,
            kl_checker=not debug.ci_disable_kl_checker,
            logprob_abs_diff_threshold=(
                THRESHOLD_DEFAULT
                if debug.ci_train_rollout_logprob_abs_diff_threshold is None
                else debug.ci_train_rollout_logprob_abs_diff_threshold
            ),
            save_grad_norm=debug.ci_save_grad_norm,
            load_grad_norm=debug.ci_load_grad_norm,
            rollout_routing_replay=cfg.algorithm.use_rollout_routing_replay,
        )
    )
    return checks if checks.options.any else None


async def _log_probs(rank: RankClient, request: LogProbsRequest) -> LogProbsResult:
    return await rank.compute_log_probs(request)


async def _train(rank: RankClient, request: TrainRequest) -> TrainResult:
    return await rank.train(request)


async def _values(rank: RankClient, request: ValuesRequest) -> ValuesResult:
    return await rank.compute_values(request)

"""The trainer ranks of a run: torchrun per actor node, one RPC handle per rank.

The head turns each rollout into train batches (rewards → advantages → steps → DP shards →
micro-batch plans) and calls every rank with the same method in the same order, as Megatron's
collectives require; ranks of one data-parallel group receive the same shard.

Leaving the pool (every exit path of the run) asks each rank to exit (`shutdown`): the ranks
leave their process groups and exit 0, so torchrun exits 0 and leaves no error file in
`logs/`. Only a job still running SHUTDOWN_GRACE seconds later is stopped by signal. Each
torchrun job's error file is `logs/trainer-node<R>-error.json`, which therefore exists only
after a real failure: a rank that raised leaves its exception and traceback there (a rank
killed by a signal leaves none; torchrun's log names it), and a job stopped by signal records
that signal there.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from tether.config import Config
from tether.placement.plan import Plan, TorchrunNode
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV
from tether.rollout.sample import Sample
from tether.run_dir import RunDir
from tether.runtime.errors import ActorDied
from tether.runtime.process import ProcessSpec
from tether.runtime.rpc import ActorHandle, connect
from tether.runtime.supervisor import LOCAL, ManagedProcess, Supervisor
from tether.train.advantages import compute_advantages, process_rewards
from tether.train.batching import (
    TrainBatch,
    build_train_batch,
    plan_micro_batches,
    shard_for_data_parallel,
    split_steps,
)
from tether.train.worker import WorkerInfo, read_addresses

log = logging.getLogger(__name__)

Groups = list[list[Sample]]
RPC_TIMEOUT = 3600.0  # a train step or a checkpoint of a large model can take long; never forever
# When a rank dies, torchrun stops the others (SIGTERM, SIGKILL after its 30 s shutdown timeout)
# and exits non-zero; its exit report (code, log tail naming the failed rank) is worth that wait.
EXIT_REPORT_TIMEOUT = 45.0
# After `shutdown` a rank finishes the work on its thread, closes its weight-sync group and
# leaves its process groups; a job not gone by then is stopped by signal.
SHUTDOWN_GRACE = 60.0


def _first(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first rank's error: what the caller (and the user) needs, not the task-group wrapper."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, Exception)
    return exc


async def _ask_to_exit(handle: ActorHandle) -> None:
    """`shutdown` on one rank; a connection dropped before the answer means it is exiting."""
    try:
        await handle.call("shutdown", timeout=SHUTDOWN_GRACE)
    except ActorDied:
        pass
    except Exception as exc:  # this rank gets the signal after the grace period instead
        log.warning("asking %s to exit failed: %s", handle.name, exc)


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
    ) -> None:
        """`engine_key`: the key engines require; rank 0 (the weight sync source) sends it."""
        self.names = names
        self.engine_key = engine_key
        self.sup = sup
        self.plan = plan
        self.cfg = cfg
        self.run_dir = run_dir
        self.secret = secret
        self.address_dir = run_dir.path / "trainer"
        self.ranks: list[ActorHandle] = []
        self.procs: list[ManagedProcess] = []
        self.infos: list[WorkerInfo] = []
        self.world_size = 0
        self.steps_done = 0

    # ----- start and stop -----
    def _spec(self, node: TorchrunNode) -> ProcessSpec:
        argv = [
            sys.executable,
            "-m",
            "tether.train.torchrun",  # torchrun, its rendezvous store on the node's address alone
            *node.torchrun_args(),
            "-m",
            "tether.train.worker",
            "--rpc-address-dir",
            str(self.address_dir),
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
            "TORCHELASTIC_ERROR_FILE": str(self.error_file(node.node_rank)),
        }
        if self.engine_key is not None:
            env[ENGINE_KEY_ENV] = self.engine_key  # read by sync.factory.engine_clients
        return ProcessSpec(
            name=f"trainer-node{node.node_rank}",
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
        return self.run_dir.logs / f"trainer-node{node_rank}-error.json"

    async def __aenter__(self) -> TrainerPool:
        group = self.plan.train_group("actor")
        if group is None:
            raise RuntimeError("the placement plan has no actor group to start")
        world = self.world_size = group.world_size
        # A run directory used again (requeued job, restarted service) still holds the last
        # start's rank addresses; only the ranks started now may be read.
        for stale in self.address_dir.glob("rank_*.json"):
            stale.unlink(missing_ok=True)

        async def all_ranks_serving() -> bool:
            return read_addresses(self.address_dir, world) is not None

        started = time.monotonic()
        starts: list[asyncio.Task[ManagedProcess]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                starts = [
                    tg.create_task(
                        self.sup.start(self._spec(n), ready=all_ranks_serving, ready_timeout=600.0)
                    )
                    for n in group.nodes
                ]
            self.procs = [t.result() for t in starts]
            addresses = read_addresses(self.address_dir, world)
            assert addresses is not None
            for r in range(world):
                self.ranks.append(
                    await connect(addresses[r], self.secret, name=f"trainer-rank{r}", timeout=60.0)
                )
            cfg = self.cfg
            infos = await self._all(
                "init",
                hf_checkpoint=cfg.rollout.hf_checkpoint,
                algorithm=cfg.algorithm,
                megatron=cfg.megatron,
                temperature=cfg.rollout.rollout_temperature,
                result_type=WorkerInfo,
            )
        except BaseException:
            # The exit stack calls __aexit__ only once __aenter__ has returned: stop here what
            # did start (a job that failed to start is already gone).
            self.procs = [t.result() for t in starts if t.done() and not t.cancelled() and not t.exception()]
            await self.__aexit__()
            raise
        self.infos = infos
        self.run_dir.event(
            "trainer_ready",
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
            for handle in self.ranks:
                await handle.close()

    async def _stop_ranks(self) -> None:
        """Ask every rank to exit; the supervisor signals a job still running after SHUTDOWN_GRACE.

        Without a connection to every rank (start-up failed half way) asking cannot reach them
        all, so the jobs are stopped by signal at once.
        """
        if not self.procs:
            return
        names = [p.name for p in self.procs]
        if len(self.ranks) < self.world_size:
            async with asyncio.TaskGroup() as tg:
                for name in names:
                    tg.create_task(self.sup.stop(name))
            return

        async def ask_all() -> None:
            async with asyncio.TaskGroup() as tg:
                for handle in self.ranks:
                    tg.create_task(_ask_to_exit(handle))

        await self.sup.stop_gracefully(names, ask_all, timeout=SHUTDOWN_GRACE)

    async def _all(self, method: str, *args: Any, result_type: Any = Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank, concurrently; results in rank order."""
        return await self._gather(method, [(args, kwargs)] * len(self.ranks), result_type)

    async def _per_rank(self, method: str, per_dp: list[dict[str, Any]], result_type: Any = Any) -> list[Any]:
        """Each rank gets the arguments of its data-parallel rank."""
        return await self._gather(method, [((), per_dp[info.dp_rank]) for info in self.infos], result_type)

    async def _gather(
        self, method: str, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], result_type: Any
    ) -> list[Any]:
        """Call every rank with its arguments; the first rank's error, as the user needs it."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(h.call(method, *a, timeout=RPC_TIMEOUT, result_type=result_type, **kw))
                    for h, (a, kw) in zip(self.ranks, calls, strict=True)
                ]
        except* Exception as group:
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
    def make_batch(self, groups: Groups) -> TrainBatch:
        """The rollout as one columnar batch with rewards as the estimator uses them."""
        algo = self.cfg.algorithm
        samples = [s for g in groups for s in g]
        raw = np.array([s.scalar_reward(self.cfg.rollout.reward_key) for s in samples], dtype=np.float64)
        group_ids = np.array(
            [s.group_index if s.group_index is not None else i for i, s in enumerate(samples)]
        )
        rewards = process_rewards(algo, raw, group_ids)
        return build_train_batch(
            samples, rewards=rewards, raw_rewards=raw, per_rollout_loss_mean=algo.per_rollout_loss_mean
        )

    def _plans(self, shards: list[TrainBatch]) -> list[list[list[int]]]:
        data = self.cfg.data
        return plan_micro_batches(
            shards,
            micro_batch_size=data.micro_batch_size,
            max_tokens_per_gpu=data.max_tokens_per_gpu if data.use_dynamic_batch_size else None,
        )

    async def _log_probs(
        self, shards: list[TrainBatch], plans: list[list[list[int]]], model: str
    ) -> list[np.ndarray]:
        results = await self._per_rank(
            "compute_log_probs",
            [{"shard": s, "plan": p, "model": model} for s, p in zip(shards, plans, strict=True)],
        )
        by_dp: dict[int, np.ndarray] = {}
        for info, result in zip(self.infos, results, strict=True):
            by_dp.setdefault(info.dp_rank, np.asarray(result["log_probs"], dtype=np.float32))
        return [by_dp[d] for d in range(len(shards))]

    async def train(self, rollout_id: int, groups: Groups, *, weight_version: int) -> dict[str, float]:
        algo = self.cfg.algorithm
        batch = self.make_batch(groups)
        data = self.cfg.data
        num_steps = max(1, batch.num_samples // data.resolved_global_batch_size)
        steps = split_steps(batch, num_steps, per_rollout_loss_mean=algo.per_rollout_loss_mean)
        needs_old = num_steps > 1 or algo.kl_coef != 0
        needs_ref = algo.needs_ref_log_probs
        metrics: dict[str, float] = {}
        for step_batch in steps:
            rl = algo.loss_type != "sft_loss"
            # Advantages over the whole step (exact whitening) unless KL shaping needs the
            # per-shard log-probs first; then each shard is whitened on its own.
            shaped = algo.kl_coef != 0
            if rl and not shaped:
                step_batch.advantages = self._advantages(step_batch)
            shards = shard_for_data_parallel(step_batch, self.dp_size)
            plans = self._plans(shards)
            if rl:
                old = await self._log_probs(shards, plans, "actor") if needs_old else [None] * len(shards)
                ref = await self._log_probs(shards, plans, "ref") if needs_ref else [None] * len(shards)
                for shard, o, r in zip(shards, old, ref, strict=True):
                    shard.old_log_probs = o
                    shard.ref_log_probs = r
                    if shaped:
                        shard.advantages = self._advantages(shard)
            results = await self._per_rank(
                "train",
                [
                    {"rollout_id": rollout_id, "shard": s, "plan": p}
                    for s, p in zip(shards, plans, strict=True)
                ],
            )
            metrics = {f"train/{k}": float(v) for k, v in results[0].items()}
            self.steps_done += 1
        metrics["train/weight_version"] = float(weight_version)
        return metrics

    def _advantages(self, shard: TrainBatch) -> np.ndarray:
        """Per-token advantages of a batch, computed on the head over the whole batch at once."""
        as_tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a))  # noqa: E731
        adv = compute_advantages(
            self.cfg.algorithm,
            rewards=torch.from_numpy(shard.rewards.astype(np.float32)),
            response_lengths=shard.response_lengths.tolist(),
            loss_mask=torch.from_numpy(shard.loss_masks.astype(np.float32)),
            log_probs=as_tensor(shard.old_log_probs),
            ref_log_probs=as_tensor(shard.ref_log_probs),
        )
        return adv.numpy().astype(np.float32)

    # ----- weights and checkpoints -----
    async def update_weights(
        self, version: int, engine_urls: list[str], *, engines_restarted: bool = False
    ) -> dict[str, Any]:
        layout = self.plan.weight_sync
        group: dict[str, Any] = {}
        if layout is not None:
            group = {
                "engine_ranks": [e.size for e in layout.engines],
                "master_address": layout.master_addr,
                "master_port": layout.master_port,
            }
        results = await self._all(
            "update_weights",
            version=version,
            engine_urls=engine_urls,
            weight_sync=self.cfg.weight_sync,
            colocate=self.plan.colocate,
            **group,
        )
        entry = next(r for r in results if r is not None)
        return dict(msgspec.to_builtins(entry))

    async def save(self, rollout_id: int, weight_version: int, position: dict[str, Any]) -> Path:
        assert self.cfg.algorithm.save is not None
        paths = await self._all(
            "save",
            save_dir=self.cfg.algorithm.save,
            step=rollout_id,
            rollout_id=rollout_id,
            weight_version=weight_version,
            data_position=position,
        )
        return Path(paths[0])

    async def load(self, load_dir: str) -> dict[str, Any] | None:
        states = await self._all("load", load_dir=load_dir)
        return states[0]

    async def export_hf(self, out_dir: str) -> None:
        await self._all("export_hf", out_dir=out_dir)

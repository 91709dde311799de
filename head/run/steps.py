"""What happens around each step of a run (the loops' StepHooks): train, sync weights, save,
evaluate, record; the job builds one `Steps` and hands it to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tether.config import Config
from tether.records.metrics import MetricsSink
from tether.records.progress import RunProgress
from tether.records.retention import CheckpointRetention
from tether.records.run_dir import RunDir
from tether.rollout.data import slime_state as slime_data_state
from tether.rollout.data.source import DataSource
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.engine_api.memory import GENERATION, WEIGHTS
from tether.run.engine_pool import EnginePool
from tether.run.loops import Groups
from tether.run.rollout_manager import RolloutManager, version_lags
from tether.run.trainer_pool import TrainerPool, ci_checks
from tether.runtime.errors import RemoteError
from tether.runtime.process.sdnotify import Notifier
from tether.runtime.process.signals import StopRequest, StopRequested
from tether.sync.ledger import LedgerEntry, VersionLedger
from tether.train.checkpoint.layout import save_hf_path

log = logging.getLogger(__name__)


class Steps:
    """What happens around each step (the loops' StepHooks): train, sync, save, evaluate, record."""

    def __init__(
        self,
        cfg: Config,
        run_dir: RunDir,
        trainer: TrainerPool | None,
        engines: EnginePool | None,
        rollouts: RolloutManager,
        sink: MetricsSink,
        progress: RunProgress,
        notifier: Notifier,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.trainer = trainer
        self.engines = engines
        self.rollouts = rollouts
        self.sink = sink
        self.progress = progress
        self.notifier = notifier
        self.version = 0
        self.step_metrics: dict[str, float] = {}
        self.completed: int | None = None  # the last rollout whose step finished
        self.position: dict[str, Any] = {}  # data position at that step's boundary
        # Trainer phases (train, sync, save) never interleave.
        self.trainer_lock = asyncio.Lock()
        # True from the moment a step's update may enter the weights until its after_step has
        # moved `completed`: a checkpoint taken then would mix two steps, so a signal's
        # checkpoint waits for the step's end (`_pending_checkpoint`) and is labelled with it.
        self.mid_step = False
        self._pending_checkpoint: asyncio.Future[None] | None = None
        self.stop_request: StopRequest | None = None
        self.retention = CheckpointRetention(cfg, run_dir)  # --load/--ref-load resolved now
        self.ledger = VersionLedger(run_dir.ledger_path)
        self._step_started = time.monotonic()
        self._stop_after_checkpoint = False
        self.total = cfg.data.num_rollout or 0
        self.checks = ci_checks(cfg)

    async def train(self, rollout_id: int, groups: Groups) -> None:
        self.step_metrics = dict(self.rollouts.metrics)
        # Staleness as trained: how far each sample's weights lag the version this step trains.
        lags = version_lags(groups, self.version)
        record = {
            "step": rollout_id,
            "trained_at_version": self.version,
            "samples": [[s.index, s.group_index, s.weight_versions] for g in groups for s in g],
        }
        self.step_metrics["rollout/version_lag_mean"] = sum(lags) / len(lags) if lags else 0.0
        self.step_metrics["rollout/version_lag_max"] = float(max(lags, default=0))
        self.step_metrics["train/trained_at_version"] = float(self.version)
        self.progress.phase(f"train step {rollout_id}")
        if self.trainer is None:
            self.run_dir.trained_samples(record)
            return
        async with self.trainer_lock:
            if self.stop_request is not None and self.stop_request.signum is not None:
                # A stop signal is being handled: its checkpoint is of the last finished step,
                # and no later update may enter the weights.
                raise StopRequested(self.stop_request.signum)
            if self.colocated:
                # The engines give all their memory to the trainer for the train phase (under the
                # lock: a catch-up sync must not take it back meanwhile); `_publish` returns it.
                assert self.engines is not None
                await self.engines.release_memory()
            self.mid_step = True
            started = time.monotonic()
            metrics = await self.trainer.train(rollout_id, groups, weight_version=self.version)
            # The update is in the weights now, and only now is the step recorded as trained.
            self.run_dir.trained_samples(record)
            metrics["train/time_s"] = time.monotonic() - started
            self.step_metrics.update(metrics)

    def sync_due(self, rollout_id: int) -> bool:
        if self.trainer is None or self.engines is None:
            return False
        return (rollout_id + 1) % self.cfg.weight_sync.update_weights_interval == 0

    async def sync_weights(self, rollout_id: int) -> int:
        attempt = 0
        while True:
            try:
                async with self.trainer_lock:
                    return await self._sync(rollout_id)
            except RemoteError as exc:
                # Under --use-fault-tolerance an engine dying mid-sync is replaced (and brought to
                # the last complete version); then the same version is published again to all.
                ft = self.cfg.fault_tolerance
                if not ft.use_fault_tolerance or self.engines is None or attempt >= ft.max_engine_restarts:
                    raise
                attempt += 1
                self.run_dir.event(
                    "sync_retry", rollout_id=rollout_id, attempt=attempt, error=str(exc)[-800:]
                )
                log.warning("weight sync failed (%s); retrying once the engines are back", exc.message[-300:])
                await self.engines.settled(
                    ft.rollout_health_check_interval + ft.rollout_health_check_timeout + 1.0
                )

    async def _sync(self, rollout_id: int, *, engines_restarted: bool = False) -> int:
        """Publish the trainer's weights as the next version; the caller holds the trainer lock."""
        assert self.trainer is not None and self.engines is not None
        self.progress.phase(f"sync v{self.version + 1}")
        started = time.monotonic()
        entry = await self._publish(self.version + 1, engines_restarted=engines_restarted)
        if self.checks is not None:  # --ci-test: every engine serves what was published
            self.checks.weights(entry.version, entry.engine_versions)
        self.version = entry.version
        self.engines.served_version = self.version
        self.step_metrics.update(
            {
                "sync/time_s": time.monotonic() - started,
                "sync/version": float(self.version),
                "sync/bytes": float(entry.bytes_moved),
                "sync/pause_s": float(entry.pause_seconds),
            }
        )
        self.ledger.record(entry)
        self.run_dir.event("weight_sync", rollout_id=rollout_id, version=self.version)
        self.rollouts.weight_version = self.version
        return self.version

    @property
    def colocated(self) -> bool:
        """Trainer and engines hand the devices' memory to each other every step (--colocate
        with --offload-rollout, its default)."""
        cluster = self.cfg.cluster
        return (
            cluster.colocate
            and cluster.offloads_rollout
            and self.trainer is not None
            and self.engines is not None
        )

    async def _publish(self, version: int, *, engines_restarted: bool = False) -> LedgerEntry:
        """The trainer's weights to the engines as `version`. Colocated, in slime's order: the
        trainer leaves the device, the engines take back their weights' memory, the update (the
        trainer brings back its weights alone to export them), then the engines' generation
        memory (KV cache, CUDA graphs)."""
        assert self.trainer is not None and self.engines is not None
        if not self.colocated:
            urls = self.engines.urls
            return await self.trainer.update_weights(
                version, urls, engines_restarted=engines_restarted, engine_sizes=self.engines.sizes_of(urls)
            )
        await self.trainer.offload()
        await self.engines.resume_memory(WEIGHTS)
        entry = await self.trainer.update_weights(
            version, self.engines.urls, engines_restarted=engines_restarted
        )
        await self.engines.resume_memory(GENERATION)
        return entry

    async def wake_engines(self) -> None:
        """Colocated, before the first rollout: the engines released all their memory at launch
        (`release_engines_at_launch`). Weights no sync has given back since are the trainer's
        again, as the version the engines serve (SGLang keeps no copy of released weights; slime
        always publishes before its first rollout): a restore, not a new version in the ledger."""
        if not self.colocated:
            return
        assert self.trainer is not None and self.engines is not None
        async with self.trainer_lock:
            if self.engines.resident(WEIGHTS):
                await self.trainer.offload()
                await self.engines.resume_memory(GENERATION)
                return
            entry = await self._publish(self.version)
            if not entry.ok:
                raise RuntimeError(f"restoring the engines' weights (v{self.version}) failed: {entry}")
            self.run_dir.event("weights_restored", version=self.version)

    @contextlib.asynccontextmanager
    async def _trainer_phase(self) -> AsyncIterator[None]:
        """Colocated: a checkpoint or HF export between steps needs the device; the engines give
        back their generation memory for it (their weights stay: they hold the served version)
        and take it again after, the trainer having left. Engines with requests in flight (a
        signal's checkpoint during a rollout) keep it: SGLang releases only an idle engine."""
        router = self.rollouts.router
        busy = router is not None and router.in_flight() > 0
        if not self.colocated or busy or self.engines is None or not self.engines.resident(GENERATION):
            yield
            return
        assert self.trainer is not None
        await self.engines.release_memory(GENERATION)
        try:
            yield
        finally:
            await self.trainer.offload()
            await self.engines.resume_memory(GENERATION)

    async def catch_up(self, client: EngineClient) -> None:
        """Bring a restarted engine to the version the others serve, before it gets a request."""
        async with self.trainer_lock:  # no sync in flight: the version is settled
            version = self.version
            if version == 0 or self.trainer is None:
                return  # it loaded --hf-checkpoint, which is version 0
            ws = self.cfg.weight_sync
            if ws.update_weight_mode == "delta":
                assert ws.update_weight_local_checkpoint_dir is not None
                # Imported here: its module imports torch, which the head's start-up does not need.
                from tether.sync.local_store import LocalCheckpointStore

                current = LocalCheckpointStore(Path(ws.update_weight_local_checkpoint_dir)).current_path()
                if current is None:
                    raise RuntimeError(
                        f"the local checkpoint store {ws.update_weight_local_checkpoint_dir} is empty"
                    )
                path = current
            elif ws.update_weight_transport == "disk" and not self.cfg.cluster.colocate:
                assert ws.update_weight_disk_dir is not None
                path = Path(ws.update_weight_disk_dir) / f"weight_v{version:06d}"
            else:
                # No full copy on disk: rebuild the update group and send everything, as a new version.
                await self._sync(self.completed if self.completed is not None else -1, engines_restarted=True)
                return
            await client.update_weights_from_disk(str(path), weight_version=str(version))
            self.run_dir.event("engine_caught_up", engine=client.name, version=version, path=str(path))

    async def after_step(self, rollout_id: int) -> None:
        cfg = self.cfg
        if self.rollouts.eval_due(rollout_id):
            self.progress.phase(f"eval {rollout_id}")
            self.step_metrics.update(await self.rollouts.evaluate(rollout_id))
        if self.engines is not None:
            self.step_metrics.update(self.engines.metrics)
        now = time.monotonic()
        samples = self.step_metrics.get("rollout/samples", 0.0)
        self.step_metrics["perf/step_s"] = now - self._step_started
        self.step_metrics["perf/samples_per_s"] = samples / max(now - self._step_started, 1e-9)
        self._step_started = now
        self.completed = rollout_id
        self.position = self.rollouts.position_after(rollout_id)
        target = cfg.run.stop_at_eval_reward
        reached = target is not None and self.step_metrics.get("eval/reward_mean", float("-inf")) >= target
        if reached:
            self._stop_after_checkpoint = True
            self.run_dir.event(
                "target_reached", rollout_id=rollout_id, eval_reward=self.step_metrics["eval/reward_mean"]
            )
        failure: BaseException | None = None
        try:
            if self.trainer is not None and cfg.algorithm.save is not None:
                interval = cfg.algorithm.save_interval
                last = rollout_id + 1 == self.total or reached
                if self._pending_checkpoint is not None:
                    await self._save("signal")
                elif last or (interval is not None and (rollout_id + 1) % interval == 0):
                    await self._save("interval")
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.mid_step = False
            # A signal that came during this save is answered by it: same step boundary.
            pending, self._pending_checkpoint = self._pending_checkpoint, None
            if pending is not None and not pending.done():
                if isinstance(failure, Exception):
                    pending.set_exception(failure)
                else:
                    pending.cancel()
        if pending is not None:
            if not pending.done():
                pending.set_result(None)
            if self.stop_request is not None and self.stop_request.signum is not None:
                # A stop signal's checkpoint was this step's: end the loop here, before the next
                # step's update can enter the weights.
                self._stop_after_checkpoint = True
        self.sink.log(rollout_id, self.step_metrics)
        self.progress.step_done(rollout_id, self.step_metrics)
        self.notifier.status(f"step {rollout_id + 1}/{self.total} version {self.version}")

    def should_stop(self) -> bool:
        return self._stop_after_checkpoint

    async def checkpoint(self) -> None:
        """A signal's checkpoint: of the last finished step when no step is under way, else of
        the step under way once it has finished — the label, data position, weight version and
        weights always belong to one step boundary."""
        if self.trainer is None or self.cfg.algorithm.save is None:
            self.run_dir.event("checkpoint_skipped", reason="signal", completed=self.completed)
            return
        pools = [p for p in (self.trainer, self.trainer.critic) if p is not None]
        lost = next((found for p in pools if (found := p.lost_node()) is not None), None)
        if lost is not None:  # the ranks' collectives lost a member: no save can complete
            self.run_dir.event(
                "checkpoint_skipped", reason="signal", completed=self.completed, lost=lost.node
            )
            return
        async with self.trainer_lock:
            if not self.mid_step:
                await self._save("signal")
                return
            if self._pending_checkpoint is None:
                self._pending_checkpoint = asyncio.get_running_loop().create_future()
            waiter = self._pending_checkpoint
        self.run_dir.event(
            "checkpoint_deferred",
            reason="signal",
            step_under_way=-1 if self.completed is None else self.completed + 1,
        )
        await asyncio.shield(waiter)

    async def _save(self, reason: str) -> None:
        """Save the state as of the last finished step; the caller is the loop or holds the lock."""
        assert self.trainer is not None
        if self.completed is None:
            self.run_dir.event("checkpoint_skipped", reason=reason, completed=None)
            return
        started = time.monotonic()
        # --async-save: the run's last checkpoint (and a signal's: the run stops) completes before
        # the answer; the others complete on the ranks before the next save or weight update.
        last = reason == "signal" or self._stop_after_checkpoint or self.completed + 1 >= self.total
        async with self._trainer_phase():
            path = await self.trainer.save(self.completed, self.version, self.position, finalize=last)
        if self._writes_slime_data_state():
            await asyncio.to_thread(self._save_slime_data_state)
        await self.rollouts.save_source(self.completed)  # a --data-source-path class saves its own state
        self.run_dir.event(
            "checkpoint",
            reason=reason,
            rollout_id=self.completed,
            version=self.version,
            path=str(path),
            seconds=time.monotonic() - started,
        )
        self.progress.message(f"checkpoint of step {self.completed} saved to {path} ({reason})")
        if self.cfg.run.save_hf is not None:
            await self.export_hf(self.completed)
        await self.retention.prune()

    def _writes_slime_data_state(self) -> bool:
        """Whether a checkpoint gets slime's data-position file: the run draws from tether's own
        data source (a --data-source-path class writes its own, as in slime)."""
        from tether.rollout.data.custom_source import HookDataSource

        data = self.rollouts.data
        return isinstance(data, DataSource) and not isinstance(data, HookDataSource)

    def _save_slime_data_state(self) -> None:
        """slime's data-position file beside the checkpoint (`tether.rollout.data.slime_state`), so
        slime can resume a tether --save directory."""
        save = self.cfg.algorithm.save
        if save is not None and self.completed is not None:
            slime_data_state.write_state(save, self.completed, self.position)

    async def export_hf(self, rollout_id: int) -> None:
        """--save-hf: the actor's weights as an HF directory at `save_hf.format(rollout_id=...)`
        (slime's meaning: one per checkpoint with a `{rollout_id}` field, else overwritten)."""
        assert self.trainer is not None and self.cfg.run.save_hf is not None
        path = save_hf_path(self.cfg.run.save_hf, rollout_id)
        async with self._trainer_phase():
            await self.trainer.export_hf(path)
        self.run_dir.event("saved_hf", path=path, rollout_id=rollout_id)

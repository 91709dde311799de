"""One run of `tether run`: set up every component, run the loop, shut everything down.

    run dir + receipt → supervisor → engines → trainer ranks → rollout manager
      → (resume) → loop under signal handling, failure watching and the systemd watchdog

Every process is started through the supervisor, which owns it; leaving the `async with`
blocks stops them all, on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tether.checks.critic import uses_critic
from tether.config import Config, counts_epochs, with_counted_epochs
from tether.placement.inventory import discover_inventory
from tether.placement.plan import Plan, plan_from_config
from tether.records.metrics import MetricsSink
from tether.records.progress import RunProgress
from tether.records.run_dir import RunDir, default_run_dir, redact_argv
from tether.rollout.data import slime_state as slime_data_state
from tether.rollout.data.custom_source import DEFAULT_ROLLOUT, is_custom_source
from tether.rollout.data.source import DataSource
from tether.rollout.engine_api.auth import run_key
from tether.rollout.routing.router import Router
from tether.run.engine_pool import EnginePool, EngineRestartsExhausted
from tether.run.live_status import live_status
from tether.run.loops import Groups, LoopRange, async_loop, fully_async_loop, sync_loop
from tether.run.nodes.capacity import RunCapacity
from tether.run.nodes.names import node_names, remote_nodes, used_nodes
from tether.run.nodes.ports import PortClaims, plan_with_free_ports
from tether.run.nodes.trainer_loss import end_run, find_lost
from tether.run.rollout_manager import RolloutManager, load_rollout_inputs
from tether.run.steps import Steps
from tether.run.trainer_pool import TrainerPool
from tether.runtime.errors import ActorDied, ConfigError, HeartbeatLost, RemoteError, find_exception
from tether.runtime.files.atomic_file import write_bytes_atomic
from tether.runtime.process import task_dump
from tether.runtime.process.sdnotify import Notifier
from tether.runtime.process.signals import StopRequest, StopRequested, handle_signals
from tether.runtime.process.supervisor import LOCAL, Heartbeat, Supervisor
from tether.runtime.rpc.secret import SECRET_ENV, new_secret, secret_from_env
from tether.train.checkpoint.layout import StartChoice, StartKind, holds_megatron_checkpoint, start_attempts
from tether.train.config import AlgorithmConfig

if TYPE_CHECKING:
    from tether.train.rank.protocol import LoadedState

log = logging.getLogger(__name__)


async def _start_trainers(stack: contextlib.AsyncExitStack, pools: list[TrainerPool]) -> None:
    """Start the trainer jobs (the actor's, and PPO's critic's) side by side: each start is
    mostly waiting for torchrun and the model build. A started pool is left on `stack`; one
    whose start fails stops what it started, and the others' starts are cancelled."""

    async def start(pool: TrainerPool) -> None:
        await pool.__aenter__()
        stack.push_async_exit(pool.__aexit__)

    try:
        async with asyncio.TaskGroup() as tg:
            for pool in pools:
                tg.create_task(start(pool))
    except* Exception as group:  # the first failure as the user needs it, not the task group
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group


def overlap_start(cfg: Config) -> bool:
    """Whether the engines (and the rollout manager after them) start while the trainer ranks
    start: each side is mostly its processes' imports and model loads, and the trainers need
    nothing of the engines' until the first weight sync. Not under --colocate (both sides would
    take the same devices' memory at once), nor where --num-epoch counts the rollouts the
    trainers' LR schedule needs first."""
    return not cfg.cluster.colocate and not counts_epochs(cfg)


def starts_rollout_early(cfg: Config) -> bool:
    """Whether the first rollout generates while the trainer ranks start (engines up first).

    Only where the engines already serve the weights the first step trains from: a fresh run
    from --hf-checkpoint, which the engines load too (nothing in --load or --ref-load, no
    --auto-resume), with the trainers starting beside the engines (`overlap_start`). Not where
    something else must reach the engines first: --check-weight-update-equal's snapshot, or the
    engine monitor that --use-fault-tolerance starts with the loop (a rollout before it could
    not wait out an engine's restart).
    """
    algorithm = cfg.algorithm
    fresh = not start_attempts(
        algorithm.load,
        algorithm.ref_load,
        auto_resume=cfg.run.auto_resume,
        save=algorithm.save,
        load_is_hf=False,  # any --load is an attempt; whether it is HF does not matter here
    )
    return fresh and _may_start_rollout_early(cfg)


def _may_start_rollout_early(cfg: Config) -> bool:
    """What any early first rollout needs besides the weights (`starts_rollout_early`)."""
    debug = cfg.debug
    return (
        overlap_start(cfg)
        and not (debug.debug_rollout_only or debug.debug_train_only)
        and not debug.check_weight_update_equal
        and not cfg.fault_tolerance.use_fault_tolerance
    )


def speculates_rollout_early(cfg: Config) -> bool:
    """Whether the first rollout generates while the trainer ranks start on weights the actor
    may not start from: --ref-load, an HF --load, or a --load in which the head sees no
    checkpoint (slime's first launch: `--load` = `--save`, empty, and `--ref-load` the base
    model's Megatron conversion). The engines serve --hf-checkpoint's weights; once the actor
    has loaded, `resume` keeps the rollout if the actor holds exactly those weights
    (`TrainerPool.hf_difference`) and discards it unseen otherwise, drawing its prompts again
    after the weight sync. Only where a discard puts everything back: tether's own rollout
    function and data source, not the fully-async worker (it draws ahead without end).
    """
    if starts_rollout_early(cfg) or not _may_start_rollout_early(cfg):
        return False
    algorithm = cfg.algorithm
    attempts = start_attempts(
        algorithm.load, algorithm.ref_load, auto_resume=cfg.run.auto_resume, save=algorithm.save
    )
    resumes = any(
        c.kind is StartKind.RESUME and c.path is not None and holds_megatron_checkpoint(Path(c.path))
        for c in attempts
    )
    return (
        not resumes
        and cfg.run.loop != "fully-async"
        and cfg.rollout.rollout_function_path in (None, DEFAULT_ROLLOUT)
        and not is_custom_source(cfg.rollout.data_source_path)
    )


async def _concurrently(*starts: Coroutine[Any, Any, None]) -> None:
    """Run `starts` at once; the first failure cancels the others and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as tg:
            for start in starts:
                tg.create_task(start)
    except* Exception as group:  # the first failure as the user needs it, not the task group
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group


def make_plan(cfg: Config, claims: PortClaims | None = None) -> Plan:
    """The placement plan, with its port block moved past ports already taken on this machine
    (and, with `claims`, claimed against other runs started at the same time)."""
    inventory = discover_inventory(cfg.cluster)
    return plan_with_free_ports(
        cfg.cluster,
        lambda cluster: plan_from_config(
            cluster,
            cfg.debug.debug_rollout_only,
            cfg.debug.debug_train_only,
            inventory,
            use_critic=uses_critic(cfg.algorithm),
            sglang_args=cfg.sglang_args,
        ),
        claims=claims,
    )


async def release_engines_at_launch(cfg: Config, pool: EnginePool, router: Router) -> None:
    """Colocated: the engines give back all their memory right after launch, before the trainer
    builds its model on the same devices (slime's order); `Steps.wake_engines` returns it before
    the first rollout. --check-weight-update-equal snapshots their weights first, while they
    still hold them."""
    if not pool.releases_memory:
        return
    if cfg.debug.check_weight_update_equal:
        from tether.run.weight_update_check import snapshot_engine_weights

        await snapshot_engine_weights(router)
    await pool.release_memory()


async def run_job(cfg: Config, argv: list[str]) -> int:
    """Run one job; returns the process exit code."""
    run_path = Path(cfg.run.run_dir) if cfg.run.run_dir else default_run_dir()
    run_dir = RunDir(run_path)
    # Inventory probing and package metadata take seconds: never on the event loop.
    claims = PortClaims()  # this machine's ports of the plan, held until the run ends
    try:
        plan = await asyncio.to_thread(make_plan, cfg, claims)
        return await _run_planned(cfg, argv, run_dir, plan)
    finally:
        claims.release()


async def _run_planned(cfg: Config, argv: list[str], run_dir: RunDir, plan: Plan) -> int:
    run_path = run_dir.path
    await asyncio.to_thread(run_dir.write_receipt, cfg, plan, argv=argv)
    names = node_names(plan)
    bind_host = head_bind_host(cfg, plan, names)  # refused here, before anything starts
    run_dir.event("start", argv=redact_argv(argv))
    notifier = Notifier.from_env()
    task_dump.install(run_dir.logs)
    sink = MetricsSink(
        run_dir,
        metrics_port=cfg.run.metrics_port,
        use_tensorboard=cfg.run.use_tensorboard,
        tb_project_name=cfg.run.tb_project_name,
        tb_experiment_name=cfg.run.tb_experiment_name,
        use_wandb=cfg.run.use_wandb,
        wandb_project=cfg.run.wandb_project,
        wandb_group=cfg.run.wandb_group,
        wandb_team=cfg.run.wandb_team,
        wandb_host=cfg.run.wandb_host,
        wandb_key=cfg.run.wandb_key,
        wandb_mode=cfg.run.wandb_mode,
        wandb_dir=cfg.run.wandb_dir,
        wandb_run_id=cfg.run.wandb_run_id,
        wandb_random_suffix=not cfg.run.disable_wandb_random_suffix,
        tracker_step=cfg.data.train_step_of if cfg.run.wandb_always_use_train_step else None,
    )
    progress = RunProgress(cfg.data.num_rollout or 0, 0, cfg.run.progress)
    progress.message(f"run directory: {run_path}")
    holder: list[Steps] = []  # the run's Steps once built: a signal's checkpoint goes there
    trainers: list[TrainerPool] = []  # whose lost node, if any, ended the run
    stop: StopRequest | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            # Signals are handled from the start: a SIGTERM (or SLURM's USR1, forwarded as TERM)
            # during start-up stops the run cleanly (exit 0, "stopped"), so it is requeued.
            stop = await stack.enter_async_context(handle_signals(_signal_checkpoint(holder, run_dir)))
            stop_watch = asyncio.ensure_future(_cancel_on_stop(stop, asyncio.current_task()))
            stack.callback(stop_watch.cancel)
            # Agents on other nodes share the secret through their environment (launch scripts
            # export it); a run on one machine makes its own.
            secret = secret_from_env() if SECRET_ENV in os.environ else new_secret()
            # Every engine requires this key; engines, the router and trainer ranks get it in
            # their environment (engines and the router without the run secret).
            engine_key = run_key(cfg.rollout.engine_api_key_file)
            sup = await stack.enter_async_context(
                Supervisor(
                    run_path,
                    secret,
                    bind_host=bind_host,
                    port=cfg.run.head_port,
                    heartbeat=control_heartbeat(cfg),
                )
            )
            sup.status_provider = live_status(sup, plan, names, holder)  # `tether status`
            write_bytes_atomic(run_path / "head_address", sup.address.encode())
            remote = remote_nodes(plan, names)
            if remote:
                progress.message(f"waiting for node agents {remote} at {sup.address}")
                await sup.wait_for_agents(remote, cfg.run.agents_timeout)
                run_dir.event("agents_ready", nodes=remote)
            engines: EnginePool | None = None
            router: Router | None = None
            rollouts: RolloutManager | None = None
            trainer: TrainerPool | None = None
            # Three stacks, entered in this order, so they close as a serial start would: the
            # rollout manager first, then the trainers (whose shut-down still tells the engines
            # to drop the weight-update group), then the engines.
            engine_stack = await stack.enter_async_context(contextlib.AsyncExitStack())
            trainer_stack = await stack.enter_async_context(contextlib.AsyncExitStack())
            rollout_stack = await stack.enter_async_context(contextlib.AsyncExitStack())

            async def start_rollout_side() -> None:
                nonlocal engines, router, rollouts
                inputs = None
                if overlap:
                    # The tokenizer and prompts load while the engines start (seconds of CPU
                    # that would otherwise follow them); an engine failing first leaves the
                    # thread to finish, its outcome read.
                    inputs = asyncio.ensure_future(asyncio.to_thread(load_rollout_inputs, cfg))
                    inputs.add_done_callback(lambda f: f.cancelled() or f.exception())
                if not cfg.debug.debug_train_only:
                    progress.phase("starting engines")
                    pool = await engine_stack.enter_async_context(
                        EnginePool(sup, plan, cfg, run_dir, names, api_key=engine_key)
                    )
                    engines = pool
                    router_url = await pool.start_sglang_router() if cfg.rollout.use_sglang_router else None
                    router = Router.from_config(
                        cfg.rollout, pool.urls, router_url=router_url, api_key=engine_key
                    )
                    if not cfg.debug.debug_rollout_only:
                        await release_engines_at_launch(cfg, pool, router)
                if overlap:  # else after the trainers, as before
                    rollouts = await rollout_stack.enter_async_context(RolloutManager(cfg, router, inputs))
                    # slime evaluates the first weights before the first rollout: not at once.
                    if not rollouts.eval_before_train():
                        if starts_rollout_early(cfg):
                            await rollouts.start_early(0)
                            run_dir.event("rollout_started_early", rollout_id=0)
                        elif await asyncio.to_thread(speculates_rollout_early, cfg):  # reads --load
                            await rollouts.start_early(0, speculative=True)
                            run_dir.event("rollout_started_early", rollout_id=0, speculative=True)

            async def start_trainer_side(into: contextlib.AsyncExitStack) -> None:
                nonlocal trainer
                if cfg.debug.debug_rollout_only:
                    return
                progress.phase("starting trainer")
                trainer = TrainerPool(sup, plan, cfg, run_dir, secret, names, engine_key=engine_key)
                if plan.train_group("critic") is not None:  # --advantage-estimator ppo
                    trainer.critic = TrainerPool(sup, plan, cfg, run_dir, secret, names, role="critic")
                trainers.extend(p for p in (trainer.critic, trainer) if p is not None)
                await _start_trainers(into, trainers)

            overlap = overlap_start(cfg)
            if overlap:
                await _concurrently(start_rollout_side(), start_trainer_side(trainer_stack))
            else:
                await start_rollout_side()
            if not overlap and counts_epochs(cfg):
                # --num-epoch without --num-rollout: slime counts the rollouts from the loaded
                # prompts before its trainer starts, which needs the LR schedule's horizon. The
                # prompts load here, once; the trainers, the loop and the receipt get the count.
                # Before the trainers, and closed after them, as in a serial start.
                rollouts = await trainer_stack.enter_async_context(RolloutManager(cfg, router))
                cfg = await _count_epochs(cfg, rollouts, run_dir, plan, argv)
                progress.set_total(cfg.data.num_rollout or 0, 0)
                progress.message(
                    f"--num-epoch {cfg.data.num_epoch}: {cfg.data.num_rollout} rollouts, "
                    f"--train-iters {cfg.megatron.train_iters}"
                )
            if not overlap:
                await start_trainer_side(rollout_stack if rollouts is not None else trainer_stack)
            if rollouts is None:
                rollouts = await rollout_stack.enter_async_context(RolloutManager(cfg, router))
            assert rollouts is not None  # mypy: set by a start above
            steps = Steps(cfg, run_dir, trainer, engines, rollouts, sink, progress, notifier)
            steps.stop_request = stop
            holder.append(steps)
            if engines is not None and router is not None:
                await engines.start_monitoring(router, steps.catch_up, steps.trainer_lock)
                # Nodes may join (`tether agent --join`) and be drained (`tether drain`) from now.
                sup.capacity = RunCapacity(cfg, plan, names, run_dir, engines)
            if cfg.debug.check_weight_update_equal:
                from tether.run.weight_update_check import resume_checking_weight_update

                start = await resume_checking_weight_update(
                    steps,
                    lambda: resume(cfg, steps),
                    snapshot=not (engines is not None and engines.releases_memory),
                )
            else:
                start = await resume(cfg, steps)
            await steps.wake_engines()
            if start == 0 and rollouts.eval_before_train():
                progress.phase("eval before training")
                before = await rollouts.evaluate(-1)
                sink.log(-1, before)
                progress.message(
                    f"held-out reward before training: {before.get('eval/reward_mean', float('nan')):.3f}"
                )
            notifier.ready(f"running from step {start}")
            # Engine busy seconds at the loop's edges: `tether bench e2e` takes the busy fraction
            # over exactly the steps (not start-up or shut-down).
            run_dir.event("ready", start=start, version=steps.version, engine_busy_s_total=_busy(router))
            total = total_rollouts(cfg, rollouts)
            steps.total = total
            progress.set_total(total, start)
            await run_loop(cfg, LoopRange(start, total), sup, steps, stop)
            stop_watch.cancel()  # what follows (HF export, shut-down) is not cut short
            run_dir.event("loop_done", version=steps.version, engine_busy_s_total=_busy(router))
            if trainer is not None and cfg.run.save_hf is not None and cfg.algorithm.save is None:
                # With --save, every checkpoint exported its HF weights (`Steps._save`).
                progress.phase("saving HF weights")
                await steps.export_hf(-1 if steps.completed is None else steps.completed)
        run_dir.event("finished", version=steps.version)
        progress.message(f"done: receipt {run_dir.receipt_path}, metrics {run_dir.metrics_path}")
        return 0
    except BaseException as exc:
        stopped = find_exception(exc, StopRequested)
        if stopped is None and stop is not None and stop.signum is not None and stop.is_set():
            if find_exception(exc, asyncio.CancelledError) is not None:  # cut short by _cancel_on_stop
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                stopped = StopRequested(stop.signum)
        if stopped is not None:
            run_dir.event("stopped", signal=stopped.signum)
            progress.message(f"stopped by {stopped}")
            return 0
        lost = find_lost(exc, trainers)
        if lost is not None:  # the step cannot finish: stop at the last checkpoint (or requeue)
            return await end_run(lost, cfg.algorithm.save, run_dir, progress)
        failure = (
            find_exception(exc, ActorDied)
            or find_exception(exc, HeartbeatLost)
            or find_exception(exc, EngineRestartsExhausted)
        )
        if failure is None:
            # Anything else still ends the record with what failed where, then propagates.
            cause = _first_leaf(exc)
            process = cause.actor if isinstance(cause, RemoteError) and cause.actor else "head"
            run_dir.event("failed", process=process, error=f"{type(cause).__name__}: {cause}"[-2000:])
            raise
        process = failure.name if isinstance(failure, ActorDied | HeartbeatLost) else "engines"
        run_dir.event("failed", process=process, error=str(failure))
        print(f"tether run: {failure}", file=sys.stderr)
        return 1
    finally:
        notifier.stopping()
        progress.close()
        sink.close()


def _signal_checkpoint(holder: list[Steps], run_dir: RunDir) -> Callable[[], Awaitable[None]]:
    """A signal's checkpoint: the run's Steps take it once they exist; before that nothing has
    been trained in this attempt, so there is nothing to save."""

    async def checkpoint() -> None:
        if holder:
            await holder[0].checkpoint()
        else:
            run_dir.event("checkpoint_skipped", reason="signal", completed=None, phase="start-up")

    return checkpoint


async def _cancel_on_stop(stop: StopRequest, task: asyncio.Task[Any] | None) -> None:
    """Once a stop signal was handled (after its checkpoint), end whatever the run is doing."""
    await stop.wait()
    if task is not None:
        task.cancel()


def _busy(router: Router | None) -> float:
    """Seconds the engines have had at least one request in flight, summed over engines."""
    return sum(router.busy_seconds().values()) if router is not None else 0.0


def _first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside nested exception groups (the one that ended the run)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def control_heartbeat(cfg: Config) -> Heartbeat:
    """Heartbeats between the head and its agents and actors; agents learn them at setup."""
    return Heartbeat(misses=cfg.run.heartbeat_misses)


def head_bind_host(cfg: Config, plan: Plan, names: dict[int, str]) -> str:
    """--head-bind-host, or by default the head node's planned address when agents on other
    machines must reach it (loopback for a run on one machine). Loopback with nodes on other
    machines is refused: their agents could never connect."""
    others = [n for n in plan.nodes if names[n.index] != LOCAL and n.index in used_nodes(plan)]
    away = [n for n in others if not _is_loopback(n.address)]
    own = next((n.address for n in plan.nodes if names[n.index] == LOCAL), "127.0.0.1")
    host = cfg.run.head_bind_host
    if host is None:
        return own if away else "127.0.0.1"
    if away and _is_loopback(host):
        raise ConfigError(
            "--head-bind-host",
            host,
            f"is a loopback address, but the agents of {[n.hostname for n in away]} connect from other "
            f"machines; bind the head node's address ({own}), or leave the flag unset to get it",
        )
    return host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def total_rollouts(cfg: Config, rollouts: RolloutManager) -> int:
    """--num-rollout, or --num-epoch passes over the prompts (counted as `_count_epochs` does)."""
    data = cfg.data
    if data.num_rollout is not None:
        return data.num_rollout
    if data.num_epoch is not None and rollouts.data is not None:
        counted = with_counted_epochs(cfg, prompt_count(rollouts.data, cfg)).data.num_rollout
        assert counted is not None
        return counted
    raise ConfigError("--num-rollout", None, "must be set (or --num-epoch with --prompt-data)")


def prompt_count(data: DataSource, cfg: Config) -> int:
    """The data source's length (slime's `len(data_source)`); a --data-source-path class without a
    usable `__len__` cannot be counted in epochs."""
    try:
        return len(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            "--data-source-path",
            cfg.rollout.data_source_path,
            f"has no usable len() ({type(exc).__name__}: {exc}), which --num-epoch {cfg.data.num_epoch} "
            "counts rollouts from (len // --rollout-batch-size, as slime does): give the class "
            "__len__ or set --num-rollout",
        ) from exc


async def _count_epochs(
    cfg: Config, rollouts: RolloutManager, run_dir: RunDir, plan: Plan, argv: list[str]
) -> Config:
    """`cfg` with --num-rollout and --train-iters counted from the loaded prompts, recorded in the
    receipt (rewritten) and the events before anything trains."""
    assert rollouts.data is not None  # --disable-rollout-global-dataset refuses --num-epoch
    prompts = prompt_count(rollouts.data, cfg)
    cfg = with_counted_epochs(cfg, prompts)
    rollouts.config = cfg
    await asyncio.to_thread(run_dir.write_receipt, cfg, plan, argv=argv)
    run_dir.event(
        "epochs_counted",
        prompts=prompts,
        num_epoch=cfg.data.num_epoch,
        num_rollout=cfg.data.num_rollout,
        train_iters=cfg.megatron.train_iters,
        lr_decay_iters=cfg.megatron.lr_decay_horizon,
    )
    return cfg


async def resume(cfg: Config, steps: Steps) -> int:
    """Load what the actor starts from, as slime chooses it (`start_attempts`): a checkpoint to
    resume from, or weights to start a fresh run from (an HF --load, --ref-load); the engines get
    those weights before the first rollout. Returns the first rollout id to run."""
    if steps.trainer is None:
        return 0
    algorithm = cfg.algorithm
    attempts = await asyncio.to_thread(
        start_attempts,
        algorithm.load,
        algorithm.ref_load,
        auto_resume=cfg.run.auto_resume,
        save=algorithm.save,
    )
    state = None
    for choice in attempts:
        assert choice.path is not None
        state = await steps.trainer.load(
            choice.path,
            finetune=choice.finetune or algorithm.finetune,
            hf=choice.hf,
            **_ckpt_step(choice, algorithm),
        )
        if state is not None:
            break
        steps.run_dir.event("resume_skipped", load=choice.path, flag=choice.flag)
    if state is None:
        what = ", ".join(f"{c.flag}={c.path}" for c in attempts) or "nothing to load"
        _discard_after(steps, -1, f"no checkpoint ({what}): starting from --hf-checkpoint")
        await _keep_early_rollout(steps, cfg, 0, same_weights=True)
        return 0
    for bad in state.skipped:
        # A damaged newest checkpoint (e.g. a truncated shard): the ranks fell back to an older one.
        steps.run_dir.event("checkpoint_damaged", path=bad.path, error=bad.error, used=state.path)
        message = f"checkpoint {bad.path} is damaged ({bad.error}); resuming from {state.path} instead"
        log.warning("%s", message)
        steps.progress.message(f"warning: {message}")
    published = max((entry.version for entry in steps.ledger.entries), default=0)
    if state.rollout_id < 0:
        # Weights only (an HF --load, --ref-load, a release checkpoint, --finetune): a fresh run from them.
        first = fresh_start_rollout_id(choice)
        kept = await _keep_early_rollout(steps, cfg, first, same_weights=False)
        _discard_after(steps, -1, f"started from {state.path}")
        steps.run_dir.event(
            "started_from", source=choice.kind.value, flag=choice.flag, path=state.path, start=first
        )
        if first > 0:
            # slime's rollout manager then loads its data position of rollout start - 1 from --load.
            position = await _slime_position(steps, state, rollout_id=first - 1)
            if position:
                steps.position = position
                steps.rollouts.load_position(position)
        # The engines loaded --hf-checkpoint (version 0): publish these weights as the next
        # version, unless they are those very weights (the early rollout generated on them, kept).
        if steps.engines is not None and not kept:
            steps.version = published
            await steps.sync_weights(-1)
        steps.progress.message(
            f"starting from {state.path} ({choice.reason}) at rollout {first}, weights v{steps.version}"
        )
        return first
    await _keep_early_rollout(steps, cfg, state.rollout_id + 1, same_weights=False, resumed=True)
    _discard_after(steps, state.rollout_id, f"resumed from {state.path}")
    steps.completed = state.rollout_id
    position = state.data_position or await _slime_position(steps, state)
    steps.position = position
    steps.rollouts.load_position(position)
    steps.run_dir.event(
        "resumed",
        load=choice.path,
        path=state.path,
        rollout_id=state.rollout_id,
        version=state.weight_version,
    )
    # The engines start from --hf-checkpoint (version 0); bring them to the resumed weights first.
    # Versions only increase in a run's ledger: when this run directory already published the
    # checkpoint's version or a later one (a crash after the checkpoint), or the checkpoint has
    # none (another tool's), the restored weights get a new number.
    version = state.weight_version
    if version <= published:
        version = published + 1
    if steps.engines is not None:
        steps.version = version - 1
        await steps.sync_weights(state.rollout_id)
    else:
        steps.version = version
    steps.progress.message(
        f"resumed from {choice.path} after step {state.rollout_id}, weights v{steps.version}"
    )
    return state.rollout_id + 1


def _ckpt_step(choice: StartChoice, algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The step flag of a load, as slime applies them: --ckpt-step to --load; to --ref-load its
    --ref-ckpt-step, else --ckpt-step (slime_validate_args, load_other_checkpoint)."""
    if choice.hf:
        return {}
    if choice.kind is StartKind.REF_LOAD and algorithm.ref_ckpt_step is not None:
        return {"ckpt_step": algorithm.ref_ckpt_step, "ckpt_step_flag": "--ref-ckpt-step"}
    return {"ckpt_step": algorithm.ckpt_step, "ckpt_step_flag": "--ckpt-step"}


async def _keep_early_rollout(
    steps: Steps, cfg: Config, first: int, *, same_weights: bool, resumed: bool = False
) -> bool:
    """Decide the speculative early rollout's fate once the actor has loaded (none started:
    False). Kept when the loop starts at its rollout and the actor holds the engines' weights
    (`same_weights`: known so; else compared tensor by tensor with --hf-checkpoint); else
    cancelled, with its prompts put back, before anything is published to the engines."""
    early = steps.rollouts.speculative_early
    if early is None or steps.trainer is None:
        return False
    started = time.monotonic()
    if resumed:
        why = f"the run resumes from a checkpoint, at rollout {first}"
    elif early != first:
        why = f"the run starts at rollout {first}"
    elif steps.ledger.entries:  # an earlier launch in this run directory: versions only increase
        why = "this run directory has published weights before"
    elif same_weights:
        why = None
    else:
        assert cfg.rollout.hf_checkpoint is not None  # the engines loaded it
        why = await steps.trainer.hf_difference(cfg.rollout.hf_checkpoint)
    seconds = time.monotonic() - started
    if why is None:
        steps.run_dir.event("early_rollout_kept", rollout_id=early, compare_s=seconds)
        return True
    await steps.rollouts.discard_early()
    steps.run_dir.event("early_rollout_discarded", rollout_id=early, reason=why, compare_s=seconds)
    steps.progress.message(f"rollout {early}, generated while the trainer loaded, is discarded: {why}")
    return False


def fresh_start_rollout_id(choice: StartChoice) -> int:
    """The first rollout of a run whose actor got weights only, as slime derives its
    start_rollout_id: 0 from an HF directory or --ref-load (slime_validate_args sets it), but
    iteration + 1 = 1 from a Megatron checkpoint in --load loaded with --finetune or a `release`
    one (Megatron-LM's load_checkpoint reports iteration 0 for both)."""
    return 1 if choice.kind is StartKind.RESUME else 0


async def _slime_position(
    steps: Steps, state: LoadedState, *, rollout_id: int | None = None
) -> dict[str, Any]:
    """The data position of a checkpoint without tether's run state (slime's, Megatron-LM's):
    slime's data-state file beside it, read as slime reads it (`rollout_id`'s, by default the
    loaded iteration's), mapped onto tether's data source; {} (the data from its start) when there
    is none."""
    if not steps._writes_slime_data_state():  # no data source of tether's own to position
        return {}
    data = steps.rollouts.data
    assert data is not None
    root = Path(state.path).parent
    rollout_id = state.rollout_id if rollout_id is None else rollout_id
    path = slime_data_state.state_path(root, rollout_id)
    found = await asyncio.to_thread(slime_data_state.read_state, root, rollout_id, len(data))
    if found is None:
        steps.progress.message(f"no slime data state {path}: the prompts start over")
        return {}
    steps.run_dir.event("slime_data_state", path=str(path), rollout_id=rollout_id)
    return dict(msgspec.to_builtins(found))


def _discard_after(steps: Steps, rollout_id: int, reason: str) -> None:
    """Steps recorded after the resumed checkpoint are not in the model: say so in the records."""
    dropped = steps.run_dir.discard_steps_after(rollout_id, reason=reason)
    if dropped:
        steps.run_dir.event("steps_discarded", steps=dropped, resumed_from=rollout_id, reason=reason)
        steps.run_dir.metric({"discarded": dropped, "resumed_from": rollout_id})
        steps.progress.message(
            f"steps {dropped[0]}..{dropped[-1]} were trained after the last checkpoint and are "
            f"discarded; they run again"
        )


async def run_loop(
    cfg: Config, steps_range: LoopRange, sup: Supervisor, steps: Steps, stop: StopRequest
) -> None:
    """The loop, alongside the watchers that can end it: process failures, signals, watchdog."""
    steps.stop_request = stop
    async with asyncio.TaskGroup() as tg:
        watchers = [
            *([tg.create_task(steps.engines.watch())] if steps.engines is not None else []),
            tg.create_task(sup.watch()),
            tg.create_task(stop.raise_when_requested()),
            tg.create_task(steps.notifier.watchdog_loop()),
        ]
        try:
            if cfg.run.loop == "sync":
                await sync_loop(steps_range, steps.rollouts, steps)
            elif cfg.run.loop == "async":
                await async_loop(steps_range, steps.rollouts, steps)
            else:
                await fully_async_loop(steps_range, _Warm(steps.rollouts), steps)
        finally:
            for watcher in watchers:
                watcher.cancel()
    if stop.signum is not None:
        # The loop ended at the stop signal's checkpoint, before the signal handler said so.
        raise StopRequested(stop.signum)


class _Warm:
    """The fully-async worker as the loop sees it."""

    def __init__(self, rollouts: RolloutManager) -> None:
        self._r = rollouts

    async def get_batch(self, rollout_id: int) -> Groups:
        return await self._r.get_batch(rollout_id)

    async def pause(self) -> None:
        await self._r.pause()

    async def resume(self, weight_version: int | None) -> None:
        await self._r.resume(weight_version)

"""The profiling slice: slime's --profile-target and memory flags with Megatron's profiler flags.

Every flag here changes what a trainer rank records, and a value that would record nothing is refused
(slime accepts and ignores such values): a target no recorder uses, step bounds without the profiler,
snapshot flags without --record-memory-history.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tether.runtime.errors import ConfigError

ProfileTarget = Literal["train_overall", "train_actor", "train_log_probs"]
"""What a rank profiles: everything it runs (one step per rollout trained), its train steps, or its
log-prob passes."""

DEFAULT_TARGET: tuple[ProfileTarget, ...] = ("train_overall",)


class ProfileConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Trainer profiling: torch.profiler traces of one phase, CUDA (or memray) memory history."""

    use_pytorch_profiler: Annotated[
        bool,
        Meta(
            description="Trace the --profile-target phase on every trainer rank with torch.profiler (CPU "
            "ops, and CUDA kernels on GPUs) over steps --profile-step-start to --profile-step-end; each rank "
            "writes <phase>_rank_<rank>.<ms>.pt.trace.json.gz (a critic's: critic_<phase>_...) into the run "
            "directory's profile/ (Megatron's flag, slime's phases)."
        ),
    ] = False
    profile_step_start: Annotated[
        int,
        Meta(
            ge=0,
            description="First traced step of --use-pytorch-profiler, counted from 0 on each rank: a rollout "
            "trained for train_overall, a train step for train_actor, a log-prob pass for train_log_probs.",
        ),
    ] = 10
    profile_step_end: Annotated[
        int,
        Meta(
            ge=1, description="The step --use-pytorch-profiler stops before (the trace holds start..end-1)."
        ),
    ] = 12
    profile_target: Annotated[
        list[ProfileTarget],
        Meta(
            description="The phase the trainer profiles: train_overall (all a rank runs, a step per rollout "
            "trained), train_actor (its train steps) or train_log_probs (its log-prob passes). "
            "--use-pytorch-profiler traces one phase; --record-memory-history records over train_overall."
        ),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_TARGET))
    record_memory_history: Annotated[
        bool,
        Meta(
            description="Record each trainer rank's CUDA memory history from its start (torch's allocator "
            "history), dumped as a snapshot on an out-of-memory error and once rollout "
            "--memory-snapshot-num-steps - 1 has trained; GPU ranks only (with --memory-recorder memray: "
            "host memory, on any device)."
        ),
    ] = False
    memory_recorder: Annotated[
        Literal["torch", "memray"],
        Meta(
            description="What --record-memory-history records: torch (CUDA memory history and pickled "
            "snapshots for pytorch.org/memory_viz) or memray (a memray capture of the rank's host memory; "
            "needs the memray package and --memory-snapshot-num-steps)."
        ),
    ] = "torch"
    memory_snapshot_dir: Annotated[
        str | None,
        Meta(
            description="Directory of the memory snapshots (default: the run directory's profile/; "
            "slime's default is the working directory)."
        ),
    ] = None
    memory_snapshot_path: Annotated[
        str,
        Meta(
            description="How each snapshot's name ends: memory_snapshot_time<unix time>_rank<rank>_<this> "
            "(Megatron's flag)."
        ),
    ] = "snapshot.pickle"
    memory_snapshot_num_steps: Annotated[
        int | None,
        Meta(
            description="Dump the memory snapshot and stop recording once rollout N - 1 (rollout ids count "
            "from 0, as in slime) has trained; without it torch's recorder dumps on out-of-memory only."
        ),
    ] = None

    def __post_init__(self) -> None:
        _check_profiler(self)
        _check_memory(self)

    @property
    def enabled(self) -> bool:
        """Whether a trainer rank records anything."""
        return self.use_pytorch_profiler or self.record_memory_history

    @property
    def traced(self) -> ProfileTarget | None:
        """The phase torch.profiler traces, if any."""
        return self.profile_target[0] if self.use_pytorch_profiler else None


def _check_profiler(cfg: ProfileConfig) -> None:
    targets = set(cfg.profile_target)
    if cfg.use_pytorch_profiler:
        if len(targets) != 1:
            raise ConfigError(
                "--profile-target",
                cfg.profile_target,
                "--use-pytorch-profiler traces one phase: torch.profiler runs one session per process, "
                "and a second one started inside the first empties it",
            )
        if cfg.profile_step_end <= cfg.profile_step_start:
            raise ConfigError(
                "--profile-step-end",
                cfg.profile_step_end,
                f"must be above --profile-step-start={cfg.profile_step_start} (the trace holds steps "
                "start..end-1)",
            )
        return
    if (cfg.profile_step_start, cfg.profile_step_end) != (10, 12):
        flag, value = (
            ("--profile-step-start", cfg.profile_step_start)
            if cfg.profile_step_start != 10
            else ("--profile-step-end", cfg.profile_step_end)
        )
        raise ConfigError(flag, value, "bounds the torch.profiler trace: it needs --use-pytorch-profiler")
    if not cfg.record_memory_history and tuple(cfg.profile_target) != DEFAULT_TARGET:
        raise ConfigError(
            "--profile-target",
            cfg.profile_target,
            "picks what --use-pytorch-profiler traces and --record-memory-history records; give one of them",
        )


def _check_memory(cfg: ProfileConfig) -> None:
    if not cfg.record_memory_history:
        given = {
            "--memory-recorder": cfg.memory_recorder if cfg.memory_recorder != "torch" else None,
            "--memory-snapshot-dir": cfg.memory_snapshot_dir,
            "--memory-snapshot-num-steps": cfg.memory_snapshot_num_steps,
            "--memory-snapshot-path": cfg.memory_snapshot_path
            if cfg.memory_snapshot_path != "snapshot.pickle"
            else None,
        }
        for flag, value in given.items():
            if value is not None:
                raise ConfigError(
                    flag, value, "shapes the memory snapshots: it needs --record-memory-history"
                )
        return
    if "train_overall" not in cfg.profile_target:
        raise ConfigError(
            "--profile-target",
            cfg.profile_target,
            "--record-memory-history records over the whole of training: it needs train_overall here",
        )
    steps = cfg.memory_snapshot_num_steps
    if steps is not None and steps < 1:
        raise ConfigError(
            "--memory-snapshot-num-steps", steps, "must be >= 1 (rollout N - 1 is the last recorded)"
        )
    if cfg.memory_recorder == "memray" and steps is None:
        raise ConfigError(
            "--memory-recorder",
            "memray",
            "a memray capture is written when it stops: give --memory-snapshot-num-steps",
        )
    if not cfg.memory_snapshot_path or "/" in cfg.memory_snapshot_path:
        raise ConfigError(
            "--memory-snapshot-path",
            cfg.memory_snapshot_path,
            "must be a file name (it ends each snapshot's name)",
        )


def check_profile_against_run(cfg: ProfileConfig, *, cpu_devices: bool, trains: bool) -> None:
    """Profiling flags against the plan: no trainer, nothing to profile; CUDA history needs CUDA."""
    if not cfg.enabled:
        return
    flag = "--use-pytorch-profiler" if cfg.use_pytorch_profiler else "--record-memory-history"
    if not trains:
        raise ConfigError(flag, True, "profiles the trainer ranks; --debug-rollout-only starts none")
    if cfg.record_memory_history and cfg.memory_recorder == "torch" and cpu_devices:
        raise ConfigError(
            "--record-memory-history",
            True,
            "records CUDA memory history (torch.cuda.memory) and this run's trainer is on CPU devices "
            "(--cpu-devices), which have no CUDA allocator; use --memory-recorder memray for host memory, "
            "or plan on GPUs",
        )

"""tether's one configuration: typed slices per component, slime's flag names, YAML, checks.

Each component owns the slice it consumes (`tether.rollout.config.RolloutConfig`, ...). This
module composes them into `Config`, derives every command-line flag from the slices' fields
(`--` + field name with dashes; the field's Meta description is the `--help` text), loads a
YAML file given with `--config` (snake_case keys, flat as in slime or nested by slice), and
runs the checks that span slices. Everything is resolved once, before any process starts;
the result serialises to JSON for the run's receipt and loads back equal.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

if typing.TYPE_CHECKING:
    import yaml

from tether.checks.critic import check_critic, uses_critic
from tether.checks.slime_flags import refusal
from tether.placement.config import ClusterConfig
from tether.rollout.config import BUFFER_ROLLOUT, DataConfig, RolloutConfig, check_buffer_rollout
from tether.rollout.data.custom_source import (
    check_data_source_class,
    check_global_dataset_flags,
    is_custom_source,
)
from tether.run.ci_checks import check_grad_norm_template
from tether.runtime.config import FaultToleranceConfig
from tether.runtime.custom_config import read_custom_config
from tether.runtime.errors import ConfigError
from tether.sync.config import WeightSyncConfig
from tether.train.checkpoint.layout import save_hf_path
from tether.train.config import (
    AlgorithmConfig,
    MegatronConfig,
    check_algorithm_against_megatron,
    check_checkpoint_flags,
    check_layer_spec,
    check_routing_replay,
)
from tether.train.megatron_roles import role_slices
from tether.train.model.capabilities import Capabilities, check_capabilities
from tether.train.profiling.config import ProfileConfig, check_profile_against_run


class DebugConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Run only one side of the loop, and save or replay rollouts."""

    debug_rollout_only: Annotated[bool, Meta(description="Generate rollouts without starting a trainer.")] = (
        False
    )
    debug_train_only: Annotated[
        bool, Meta(description="Train without starting engines (needs saved rollouts).")
    ] = False
    save_debug_rollout_data: Annotated[
        str | None, Meta(description="Path template for each rollout's Samples, with {rollout_id}.")
    ] = None
    load_debug_rollout_data: Annotated[
        str | None, Meta(description="Path template of saved rollouts to train on, with {rollout_id}.")
    ] = None
    load_debug_rollout_data_subsample: Annotated[
        float | None,
        Meta(
            description="Train on this fraction of each saved rollout's samples (slime's rows: the first and "
            "last halves of round(n x ratio), each sample staying in its group)."
        ),
    ] = None
    load_forge_rollout_data: Annotated[
        str | None,
        Meta(
            description="Saved rollouts (a file, or a template with {rollout_id}: a missing rollout reuses 0's) "
            "that slime.rollout.forge_load.generate_rollout returns instead of generating, with the engines, "
            "weight updates and offloading all running (slime's memory-measurement mode)."
        ),
    ] = None
    save_debug_train_data: Annotated[
        str | None,
        Meta(
            description="Path template (with {rollout_id}, and slime's {rank}: the head's, 0) of a file per "
            "rollout holding what each step trained on: every data-parallel rank's shard (msgpack)."
        ),
    ] = None
    dump_details: Annotated[
        str | None,
        Meta(
            description="Dump the run's details here, as slime lays them out: rollouts under "
            "rollout_data/{rollout_id}, train data under train_data/{rollout_id}, the tokenizer under "
            "tokenizer/ (each unless its own flag says otherwise)."
        ),
    ] = None

    check_weight_update_equal: Annotated[
        bool,
        Meta(
            description="Before training, check that a weight update reproduces the engines' weights, as slime "
            "does: each engine snapshots its weights and overwrites them with noise (SGLang's /weights_checker), "
            "the trainer publishes its weights, and every engine compares them with the snapshot; any tensor "
            "that differs fails the run, named."
        ),
    ] = False

    ci_test: Annotated[
        bool,
        Meta(
            description="slime's CI checks as run-time assertions (tether.run.ci_checks): the run stops, naming "
            "the check, when the first rollout's actor and reference log-probs differ, a rollout's mean "
            "log-prob leaves (-1, 0) or its entropy (0, 1), a step's train/rollout log-prob difference exceeds "
            "--ci-train-rollout-logprob-abs-diff-threshold, the KL checks fail, or an engine misses a version."
        ),
    ] = False
    ci_disable_kl_checker: Annotated[
        bool,
        Meta(
            description="With --ci-test: skip its KL checks (first-step ppo_kl and kl_loss, rollout 0's actor vs ref)."
        ),
    ] = False
    ci_train_rollout_logprob_abs_diff_threshold: Annotated[
        float | None,
        Meta(
            description="With --ci-test: the largest train/train_rollout_logprob_abs_diff a step may log (slime's 0.1)."
        ),
    ] = None
    ci_save_grad_norm: Annotated[
        str | None,
        Meta(
            description="Save each step's grad norm (torch.save of a float, as slime) to this path template with "
            "{role}, {rollout_id}, {step_id}."
        ),
    ] = None
    ci_load_grad_norm: Annotated[
        str | None,
        Meta(
            description="Compare each step's grad norm with the one saved at this path template ({role}, "
            "{rollout_id}, {step_id}); the run stops when they differ by more than 1 percent (and 0.01)."
        ),
    ] = None

    def __post_init__(self) -> None:
        if not self.ci_test:  # slime reads these only under --ci-test; here they would do nothing
            if self.ci_disable_kl_checker:
                raise ConfigError("--ci-disable-kl-checker", True, "has no effect without --ci-test")
            if self.ci_train_rollout_logprob_abs_diff_threshold is not None:
                raise ConfigError(
                    "--ci-train-rollout-logprob-abs-diff-threshold",
                    self.ci_train_rollout_logprob_abs_diff_threshold,
                    "has no effect without --ci-test",
                )
        ratio = self.load_debug_rollout_data_subsample
        if ratio is not None:
            if self.load_debug_rollout_data is None:
                raise ConfigError(
                    "--load-debug-rollout-data-subsample",
                    ratio,
                    "subsamples --load-debug-rollout-data, not given",
                )
            if not 0.0 < ratio <= 1.0:
                raise ConfigError("--load-debug-rollout-data-subsample", ratio, "must be in (0, 1]")
        if self.ci_save_grad_norm is not None and self.ci_load_grad_norm is not None:
            # slime saves and skips the comparison when both are given.
            raise ConfigError(
                "--ci-load-grad-norm", self.ci_load_grad_norm, "contradicts --ci-save-grad-norm; give one"
            )
        for flag, template in (
            ("--ci-save-grad-norm", self.ci_save_grad_norm),
            ("--ci-load-grad-norm", self.ci_load_grad_norm),
        ):
            if template is not None:
                check_grad_norm_template(flag, template)
        if self.dump_details is not None:  # slime's defaults under the details directory
            base = self.dump_details.rstrip("/")
            if self.save_debug_rollout_data is None:
                msgspec.structs.force_setattr(
                    self, "save_debug_rollout_data", f"{base}/rollout_data/{{rollout_id}}.msgpack"
                )
            if self.save_debug_train_data is None:
                msgspec.structs.force_setattr(
                    self, "save_debug_train_data", f"{base}/train_data/{{rollout_id}}.msgpack"
                )
        if self.check_weight_update_equal and (self.debug_train_only or self.debug_rollout_only):
            flag = "--debug-train-only" if self.debug_train_only else "--debug-rollout-only"
            raise ConfigError(
                "--check-weight-update-equal",
                True,
                f"compares the engines' weights after a weight update; {flag} has none",
            )


class RunConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the head runs the job: loop mode, run directory, progress and metrics outputs."""

    loop: Annotated[
        Literal["sync", "async", "fully-async"],
        Meta(description="Training loop: sync, async or fully-async."),
    ] = "sync"
    run_dir: Annotated[
        str | None,
        Meta(description="Directory for this run's receipt, metrics, logs (default: runs/<time>)."),
    ] = None
    auto_resume: Annotated[
        bool, Meta(description="Resume from the latest complete checkpoint under --save when one exists.")
    ] = False
    metrics_port: Annotated[
        Annotated[int, Meta(ge=1, le=65535)] | None,
        Meta(description="Serve Prometheus /metrics on this port of the head."),
    ] = None
    use_wandb: Annotated[
        bool, Meta(description="Log metrics to Weights & Biases (WANDB_MODE=offline works).")
    ] = False
    wandb_project: Annotated[str | None, Meta(description="W&B project name.")] = None
    wandb_group: Annotated[str | None, Meta(description="W&B group name.")] = None
    wandb_team: Annotated[str | None, Meta(description="W&B team (entity) the run is logged under.")] = None
    wandb_host: Annotated[
        str | None, Meta(description="W&B server URL to log in to (default: the client's, wandb.ai).")
    ] = None
    wandb_key: Annotated[
        str | None,
        Meta(description="W&B API key to log in with (kept out of the run's receipt; WANDB_API_KEY works)."),
    ] = None
    wandb_mode: Annotated[
        Literal["online", "offline", "disabled"] | None,
        Meta(description="W&B mode: online, offline (local files only) or disabled; overrides WANDB_MODE."),
    ] = None
    wandb_dir: Annotated[
        str | None, Meta(description="Directory for W&B's local files (default: the run directory).")
    ] = None
    wandb_run_id: Annotated[
        str | None, Meta(description="W&B run id: log into (resume) this run instead of a new one.")
    ] = None
    train_env_vars: Annotated[
        dict[str, str],
        Meta(
            description="JSON object of extra environment variables for the trainer processes (slime's "
            "meaning), e.g. PyTorch's allocator settings."
        ),
    ] = msgspec.field(default_factory=dict)
    disable_wandb_random_suffix: Annotated[
        bool,
        Meta(
            description="Use --wandb-group as the W&B group and run name as given (by default, as in "
            "slime, a random suffix is added so that reruns do not merge)."
        ),
    ] = False
    wandb_always_use_train_step: Annotated[
        bool,
        Meta(
            description="W&B, TensorBoard and Prometheus steps count optimizer steps (rollout x steps per "
            "rollout) instead of rollouts (slime's meaning); metrics.jsonl keeps the rollout."
        ),
    ] = False
    use_tensorboard: Annotated[bool, Meta(description="Also write TensorBoard events (when installed).")] = (
        False
    )
    tb_project_name: Annotated[
        str | None,
        Meta(
            description="TensorBoard events go to tensorboard_log/<this>/<--tb-experiment-name> (relative to "
            "the working directory, as in slime) instead of the run directory's tensorboard/."
        ),
    ] = None
    tb_experiment_name: Annotated[
        str | None,
        Meta(description="Experiment directory under --tb-project-name (default: the run directory's name)."),
    ] = None
    progress: Annotated[
        Literal["auto", "rich", "plain"],
        Meta(description="Progress display: rich bars, plain lines, or auto."),
    ] = "auto"
    head_bind_host: Annotated[
        str | None,
        Meta(
            description="Address the head's control socket binds, which agents on other nodes connect to "
            "(default: the head node's planned address when nodes are on other machines, else 127.0.0.1)."
        ),
    ] = None
    head_port: Annotated[
        int, Meta(ge=0, le=65535, description="Port of the head's control socket (0: any free port).")
    ] = 0
    heartbeat_misses: Annotated[
        int,
        Meta(
            ge=1,
            description="Heartbeats in a row (1 s apart, 3 s timeout) a node agent or the head may miss "
            "before the other side counts it as lost.",
        ),
    ] = 3
    agents_timeout: Annotated[
        float,
        Meta(gt=0, description="Seconds to wait for the node agents of the plan's other nodes to register."),
    ] = 300.0
    save_hf: Annotated[
        str | None,
        Meta(
            description="Write the weights as a Hugging Face checkpoint at every checkpoint save (--save), "
            "into save_hf.format(rollout_id=N) as slime does (e.g. /out/hf_{rollout_id}); without --save "
            "once, at the end."
        ),
    ] = None
    stop_at_eval_reward: Annotated[
        float | None,
        Meta(description="Stop (after a checkpoint) once the held-out mean reward reaches this."),
    ] = None


SLICES: dict[str, type[msgspec.Struct]] = {
    "cluster": ClusterConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "megatron": MegatronConfig,
    "weight_sync": WeightSyncConfig,
    "fault_tolerance": FaultToleranceConfig,
    "debug": DebugConfig,
    "profile": ProfileConfig,
    "run": RunConfig,
}


class Config(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The resolved configuration of one run; each component receives its own slice."""

    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    fault_tolerance: FaultToleranceConfig = msgspec.field(default_factory=FaultToleranceConfig)
    debug: DebugConfig = msgspec.field(default_factory=DebugConfig)
    profile: ProfileConfig = msgspec.field(default_factory=ProfileConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    sglang_args: list[str] = msgspec.field(default_factory=list)
    """Flags passed through to SGLang: each `--sglang-<flag> [values]` becomes `--<flag> [values]`."""

    def __post_init__(self) -> None:
        check_contradictions(self)

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)

    @classmethod
    def from_json(cls, data: bytes | str) -> Config:
        return msgspec.json.decode(data, type=cls)


def check_forge_rollout(cfg: Config) -> None:
    """slime's forge mode: its rollout function and --load-forge-rollout-data go together (tether's
    default rollout would generate and leave the flag unread)."""
    from tether.rollout.slime_api.rollout.forge_load import ROLLOUT_FUNCTION

    path, dumps = cfg.rollout.rollout_function_path, cfg.debug.load_forge_rollout_data
    default = RolloutConfig.__struct_defaults__[
        RolloutConfig.__struct_fields__.index("rollout_function_path")
    ]
    if dumps is not None and path == default:
        raise ConfigError(
            "--load-forge-rollout-data",
            dumps,
            f"is read by --rollout-function-path {ROLLOUT_FUNCTION}, not given",
        )
    if path == ROLLOUT_FUNCTION and dumps is None:
        raise ConfigError("--load-forge-rollout-data", None, f"is needed by --rollout-function-path {path}")
    if dumps is not None and cfg.debug.load_debug_rollout_data is not None:
        raise ConfigError(
            "--load-forge-rollout-data",
            dumps,
            "contradicts --load-debug-rollout-data (which starts no engines)",
        )


def check_contradictions(cfg: Config) -> None:
    """Checks that span slices; each names the flags involved and their values."""
    if cfg.debug.debug_rollout_only and cfg.debug.debug_train_only:
        raise ConfigError("--debug-rollout-only", True, "contradicts --debug-train-only (nothing would run)")
    debug = cfg.debug
    if (
        debug.debug_train_only
        and debug.load_debug_rollout_data is None
        and not cfg.rollout.rollout_function_path
    ):
        # slime's --debug-train-only starts no engines; the default rollout generates on them.
        raise ConfigError(
            "--debug-train-only",
            True,
            "starts no engines: train on saved rollouts (--load-debug-rollout-data) or give a "
            "--rollout-function-path that generates nothing (slime.rollout.sft_rollout.generate_rollout)",
        )
    check_forge_rollout(cfg)
    cfg.weight_sync.check_colocate(cfg.cluster.colocate)
    check_buffer_rollout(
        cfg.rollout,
        loop=cfg.run.loop,
        use_rollout_logprobs=cfg.algorithm.use_rollout_logprobs,
        use_tis=cfg.algorithm.use_tis,
    )
    check_algorithm_against_megatron(cfg.algorithm, cfg.megatron)
    check_routing_replay(cfg.algorithm, cfg.megatron, cfg.rollout.hf_checkpoint)
    check_checkpoint_flags(cfg.algorithm, auto_resume=cfg.run.auto_resume)
    check_megatron_against_run(cfg)
    check_profile_against_run(
        cfg.profile, cpu_devices=cfg.cluster.cpu_devices is not None, trains=not cfg.debug.debug_rollout_only
    )
    check_critic(cfg.algorithm, cfg.cluster)
    for role in ("actor", "critic"):  # --megatron-config-path: each role's overrides read and checked now
        role_slices(cfg.algorithm, cfg.megatron, role)
    if cfg.algorithm.log_probs_max_tokens_per_gpu is not None and not cfg.data.use_dynamic_batch_size:
        raise ConfigError(
            "--log-probs-max-tokens-per-gpu",
            cfg.algorithm.log_probs_max_tokens_per_gpu,
            "is the token budget of dynamic micro-batches; it needs --use-dynamic-batch-size",
        )
    check_global_dataset_flags(
        cfg.data.disable_rollout_global_dataset,
        cfg.data.prompt_data,
        cfg.rollout.rollout_function_path,
        cfg.rollout.data_source_path,
    )
    if cfg.run.save_hf is not None:
        save_hf_path(cfg.run.save_hf, 0)  # a template `format` cannot fill is refused now
    if cfg.run.loop != "sync" and cfg.cluster.colocate:
        raise ConfigError(
            "--loop", cfg.run.loop, "overlaps generation and training, so it rejects --colocate"
        )
    samples = cfg.data.rollout_batch_size * cfg.data.n_samples_per_prompt
    gbs = cfg.data.global_batch_size
    if gbs is not None:
        if gbs > samples or samples % gbs:
            raise ConfigError(
                "--global-batch-size",
                gbs,
                f"must divide --rollout-batch-size x --n-samples-per-prompt = "
                f"{cfg.data.rollout_batch_size} x {cfg.data.n_samples_per_prompt} = {samples}",
            )
        if gbs % cfg.data.micro_batch_size and not cfg.data.use_dynamic_batch_size:
            raise ConfigError(
                "--global-batch-size",
                gbs,
                f"is not a multiple of --micro-batch-size={cfg.data.micro_batch_size}",
            )
    over = cfg.rollout.over_sampling_batch_size
    if over is not None and over < cfg.data.rollout_batch_size:
        raise ConfigError(
            "--over-sampling-batch-size", over, f"is below --rollout-batch-size={cfg.data.rollout_batch_size}"
        )


def trainer_world_sizes(cfg: Config) -> list[int]:
    """The ranks of each trainer group the plan makes (the actor, and the critic where it trains one),
    which share the Megatron layout; groups without devices are left to the placement's refusal."""
    cluster = cfg.cluster
    per_node = cluster.actor_num_gpus_per_node
    sizes = [cluster.actor_num_nodes * per_node]
    if cluster.critic_num_nodes is not None or uses_critic(cfg.algorithm):
        critic_nodes = cluster.critic_num_nodes or cluster.actor_num_nodes
        sizes.append(critic_nodes * (cluster.critic_num_gpus_per_node or per_node))
    return [size for size in sizes if size > 0]


def check_megatron_against_run(cfg: Config) -> None:
    """The Megatron flags against the rest of the run: the devices it plans on, the sample lengths
    rollouts produce, and the HF config when it is readable here."""
    megatron = cfg.megatron
    if cfg.cluster.cpu_devices is not None and not cfg.debug.debug_rollout_only:
        check_capabilities(
            megatron, Capabilities.cpu(), where="; this run plans on CPU devices (--cpu-devices)"
        )
    if not cfg.debug.debug_rollout_only:
        # Megatron's layout must tile each trainer group's ranks (TP x PP x CP, and the experts'
        # EP x ETP x PP): refused now, not when the ranks initialize Megatron's groups.
        for world in trainer_world_sizes(cfg):
            megatron.data_parallel_size(world)
    # A decaying schedule's horizon with --num-epoch (and no --num-rollout) is counted from the
    # prompts when `tether run` starts, before the trainer does (`with_counted_epochs`).
    rollout = cfg.rollout
    longest = rollout.rollout_max_context_len
    if longest is None and rollout.rollout_max_prompt_len and rollout.rollout_max_response_len:
        longest = rollout.rollout_max_prompt_len + rollout.rollout_max_response_len
    if megatron.seq_length is not None and longest is not None and longest > megatron.seq_length:
        raise ConfigError(
            "--seq-length",
            megatron.seq_length,
            f"is shorter than the {longest} tokens a rollout sample may hold "
            "(--rollout-max-context-len, or --rollout-max-prompt-len + --rollout-max-response-len)",
        )
    hf = rollout.hf_checkpoint
    if hf is not None and (Path(hf) / "config.json").is_file() and not cfg.debug.debug_rollout_only:
        from tether.train.model.hf_config import check_architecture_flags, check_parallel, load_arch

        arch = load_arch(hf)
        check_architecture_flags(arch, megatron.architecture())
        check_parallel(
            arch,
            megatron.tensor_model_parallel_size,
            megatron.pipeline_model_parallel_size,
            megatron.decoder_first_pipeline_num_layers,
            megatron.decoder_last_pipeline_num_layers,
            ep_size=megatron.expert_model_parallel_size,
            etp_size=megatron.expert_tensor_parallel_size,
            sequence_parallel=megatron.sequence_parallel,
            cp_size=megatron.context_parallel_size,
            allgather_cp=megatron.allgather_cp,
        )


def counts_epochs(cfg: Config) -> bool:
    """Whether the run's length is --num-epoch passes over prompts not read yet (no --num-rollout)."""
    return cfg.data.num_rollout is None and cfg.data.num_epoch is not None


def with_counted_epochs(cfg: Config, prompts: int) -> Config:
    """`cfg` with --num-rollout counted from --num-epoch as slime counts it before its trainer
    starts: (prompts // --rollout-batch-size) x --num-epoch, `prompts` being the data source's
    length after tether's filtering. --train-iters (so the LR horizon and a --lr-warmup-fraction)
    then follows from it as from a given --num-rollout. Unchanged when --num-rollout is set."""
    if not counts_epochs(cfg):
        return cfg
    data = cfg.data
    assert data.num_epoch is not None
    per_epoch = prompts // data.rollout_batch_size
    if per_epoch * data.num_epoch <= 0:
        raise ConfigError(
            "--num-epoch",
            data.num_epoch,
            f"counts whole rollout batches of the prompts, and the {prompts} prompts (after filtering) "
            f"make none of --rollout-batch-size={data.rollout_batch_size}",
        )
    counted = msgspec.structs.replace(data, num_rollout=per_epoch * data.num_epoch)
    return msgspec.structs.replace(cfg, data=counted, megatron=_with_train_iters(cfg.megatron, counted))


def check_epoch_source(cfg: Config) -> None:
    """`tether plan`/`run`, --debug-train-only included: a --data-source-path class that --num-epoch
    counts by its len() (slime's `len(data_source) // rollout_batch_size`) imports and has slime's
    DataSource methods, `__len__` among them. Imports the class, so not at resolve."""
    if counts_epochs(cfg) and is_custom_source(cfg.rollout.data_source_path):
        check_data_source_class(cfg.rollout.data_source_path)


def horizon_note(cfg: Config) -> str | None:
    """What `tether plan` says of a horizon it cannot count without reading every prompt."""
    if not counts_epochs(cfg):
        return None
    return (
        f"--num-epoch {cfg.data.num_epoch}: --num-rollout (and from it --train-iters, the LR schedule's "
        f"horizon) is counted from the prompts when the run starts: "
        f"(prompts // --rollout-batch-size {cfg.data.rollout_batch_size}) x {cfg.data.num_epoch}"
    )


def _with_train_iters(megatron: MegatronConfig, data: DataConfig) -> MegatronConfig:
    """Fill --train-iters from --num-rollout (what slime does) so the ranks know the LR horizon."""
    if megatron.train_iters is not None or data.num_rollout is None:
        return megatron
    samples = data.rollout_batch_size * data.n_samples_per_prompt
    steps = data.num_rollout * max(1, samples // data.resolved_global_batch_size)
    return msgspec.structs.replace(megatron, train_iters=steps)


# --- flags derived from the slices -------------------------------------------------------


@dataclass(frozen=True)
class FlagSpec:
    slice: str
    field: str
    flag: str
    kind: Literal["bool", "optbool", "list", "json", "scalar"]
    help: str
    choices: tuple[str, ...] | None
    repeat: bool = False
    """A list flag given once per value (`--x a --x b`, argparse's append), as slime declares some."""


def _unwrap(hint: Any) -> tuple[Any, str]:
    """The bare type of a field and its Meta description."""
    description = ""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        for extra in extras:
            if isinstance(extra, Meta) and extra.description:
                description = extra.description
        hint = base
    return hint, description


def _repeated(hint: Any) -> bool:
    """A field whose Meta says `extra={"repeat": True}`: its flag appends one value per use."""
    extras = typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ()
    return any(isinstance(e, Meta) and bool((e.extra or {}).get("repeat")) for e in extras)


def _kind(hint: Any) -> tuple[Literal["bool", "optbool", "list", "json", "scalar"], tuple[str, ...] | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    optional = False
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        hint, origin, optional = args[0], typing.get_origin(args[0]), True
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
        origin = typing.get_origin(hint)
    if hint is bool:
        return ("optbool" if optional else "bool"), None
    if origin is list:
        return "list", None
    if origin is dict:  # a JSON object on the command line, a mapping in YAML
        return "json", None
    if origin is Literal:
        return "scalar", tuple(str(a) for a in typing.get_args(hint))
    return "scalar", None


def flag_specs() -> list[FlagSpec]:
    """Every configuration flag, from the slices' fields (a run reads them twice: ~30 ms each)."""
    return list(_flag_specs())


@functools.cache  # the slices are fixed classes: their flags never change within a process
def _flag_specs() -> tuple[FlagSpec, ...]:
    specs: list[FlagSpec] = []
    for slice_name, cls in SLICES.items():
        hints = typing.get_type_hints(cls, include_extras=True)
        for name in cls.__struct_fields__:
            base, description = _unwrap(hints[name])
            kind, choices = _kind(base)
            flag = "--" + name.replace("_", "-")
            specs.append(
                FlagSpec(slice_name, name, flag, kind, description, choices, repeat=_repeated(hints[name]))
            )
    seen: dict[str, FlagSpec] = {}
    for spec in specs:
        if spec.flag in seen:  # a programming error: two slices claim one flag
            raise RuntimeError(
                f"flag {spec.flag} is declared by both {seen[spec.flag].slice} and {spec.slice}"
            )
        seen[spec.flag] = spec
    return tuple(specs)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Every configuration flag, grouped by slice, for `--help`; values are parsed by `resolve`."""
    parser.add_argument(
        "--config", metavar="YAML", help="YAML file with the same keys (snake_case); flags override it."
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in flag_specs():
        group = groups.get(spec.slice)
        if group is None:
            doc = (SLICES[spec.slice].__doc__ or "").strip().splitlines()[0]
            group = groups[spec.slice] = parser.add_argument_group(spec.slice, doc)
        dest = f"{spec.slice}.{spec.field}"
        if spec.kind == "bool":
            group.add_argument(
                spec.flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=spec.help
            )
        elif spec.kind == "optbool":  # unset means "decide from other flags"; --no-x says no
            group.add_argument(
                spec.flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=spec.help,
            )
        elif spec.kind == "list" and spec.repeat:
            group.add_argument(
                spec.flag,
                dest=dest,
                action="append",
                default=argparse.SUPPRESS,
                help=spec.help,
                metavar="VALUE",
            )
        elif spec.kind == "list":
            group.add_argument(spec.flag, dest=dest, nargs="*", default=argparse.SUPPRESS, help=spec.help)
        elif spec.kind == "json":
            group.add_argument(
                spec.flag,
                dest=dest,
                type=_json_object,
                default=argparse.SUPPRESS,
                help=spec.help,
                metavar="JSON",
            )
        else:
            # Choices are checked by msgspec with the slice, so the error names the flag and the value.
            metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else spec.field.upper()
            group.add_argument(
                spec.flag, dest=dest, default=argparse.SUPPRESS, help=spec.help, metavar=metavar
            )
    parser.add_argument_group("sglang", "Any --sglang-<flag> [values] goes to SGLang as --<flag> [values].")


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (argparse reports the ValueError with the flag's name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object")
    return value


_SGLANG_PREFIX = "--sglang-"


def split_sglang_args(argv: Sequence[str], known_flags: set[str]) -> tuple[list[str], list[str]]:
    """Separate pass-through `--sglang-*` flags (with their values) from tether's own flags."""
    ours: list[str] = []
    passthrough: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name.startswith(_SGLANG_PREFIX) and name not in known_flags:
            passthrough.append("--" + token[len(_SGLANG_PREFIX) :])
            i += 1
            while "=" not in token and i < len(argv) and not argv[i].startswith("--"):
                passthrough.append(argv[i])
                i += 1
            continue
        ours.append(token)
        i += 1
    return ours, passthrough


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        match = re.search(r"unrecognized arguments: (\S+)(?: (\S+))?", message)
        if match:
            flag, after = match.group(1), match.group(2)
            why = refusal(flag)
            if why is not None:  # one of slime's flags tether does not run: say why
                value = (
                    flag.split("=", 1)[1]
                    if "=" in flag
                    else (after if after and not after.startswith("--") else True)
                )
                raise ConfigError(flag.split("=", 1)[0], value, why)
            raise ConfigError(flag, None, "is not a tether, slime or Megatron flag")
        match = re.search(r"argument (--[\w-]+)(?:/\S+)?: (.*)", message)
        if match:
            raise ConfigError(match.group(1), None, match.group(2))
        raise ConfigError("command line", None, message)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's complaint and where, on one line (its own text spans several with a caret)."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def _yaml_values(
    path: Path, by_field: dict[str, list[FlagSpec]]
) -> tuple[dict[tuple[str, str], Any], list[str]]:
    import yaml  # only with --config: not on every run's way to its first process

    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot be read as YAML: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("--config", str(path), f"cannot be read as YAML: {_yaml_problem(exc)}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            "--config", str(path), f"must hold a mapping of keys to values, not {type(loaded).__name__}"
        )
    values: dict[tuple[str, str], Any] = {}
    sglang: list[str] = []

    def put(key: str, value: Any, section: str | None) -> None:
        if key == "sglang_args" and section is None:
            if not isinstance(value, list):
                raise ConfigError(f"{path}: sglang_args", value, "must be a list of strings")
            sglang.extend(str(v) for v in value)
            return
        specs = [s for s in by_field.get(key, []) if section is None or s.slice == section]
        if not specs:
            if key.startswith("sglang_") and section is None:
                flag = "--" + key[len("sglang_") :].replace("_", "-")
                if value is True:
                    sglang.append(flag)
                elif value is not False and value is not None:
                    sglang.extend([flag, *(map(str, value) if isinstance(value, list) else [str(value)])])
                return
            where = f"{section}.{key}" if section else key
            raise ConfigError(f"{path}: {where}", value, "is not a configuration key")
        values[(specs[0].slice, key)] = value

    for key, value in loaded.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: key", key, "must be a string")
        if key in SLICES and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                put(str(sub_key), sub_value, key)
        else:
            put(key, value, None)
    return values, sglang


SLIME_FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
"""slime's fully-async rollout function: in tether, the fully-async loop (its warm worker queue)."""


def _slime_fully_async(values: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """slime's scripts pick fully-async rollouts with --rollout-function-path SLIME_FULLY_ASYNC (run
    by train_async.py); tether runs them as --loop fully-async with its own rollout function, which
    calls the same --custom-generate-function-path and --custom-rm-path hooks."""
    if values.get(("rollout", "rollout_function_path")) != SLIME_FULLY_ASYNC:
        return values
    loop = values.get(("run", "loop"), "fully-async")
    if loop != "fully-async":
        raise ConfigError(
            "--loop",
            loop,
            f"contradicts --rollout-function-path {SLIME_FULLY_ASYNC} (slime's fully-async rollout)",
        )
    out = {k: v for k, v in values.items() if k != ("rollout", "rollout_function_path")}
    out[("run", "loop")] = "fully-async"
    return out


SLIME_BUFFER_EXAMPLE = "slime_plugins.rollout_buffer.rollout_buffer_example.generate_rollout"
"""slime's rollout-buffer example: in tether, its own client of the same protocol (BUFFER_ROLLOUT)."""


def _slime_buffer_example(values: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """slime's rollout-buffer scripts name the example's rollout function; tether runs its own client
    of the same buffer protocol, which numbers samples as its Sample contract wants (the example
    gives a group's samples one index) and builds the same tokens, masks and rewards."""
    key = ("rollout", "rollout_function_path")
    if values.get(key) != SLIME_BUFFER_EXAMPLE:
        return values
    return {**values, key: BUFFER_ROLLOUT}


def resolve(argv: Sequence[str]) -> Config:
    """The Config from a command line (and the YAML file it names); raises ConfigError."""
    specs = flag_specs()
    by_flag = {s.flag: s for s in specs}
    by_field: dict[str, list[FlagSpec]] = {}
    for s in specs:
        by_field.setdefault(s.field, []).append(s)
    argv, sglang_cli = split_sglang_args(argv, set(by_flag))
    _check_spec_first(argv)
    parser = _Parser(prog="tether run", add_help=False, allow_abbrev=False)
    add_config_arguments(parser)
    namespace = parser.parse_args(list(argv))
    values: dict[tuple[str, str], Any] = {}
    origin: dict[tuple[str, str], str] = {}
    sglang: list[str] = []
    config_path = getattr(namespace, "config", None)
    if config_path:
        yaml_values, sglang = _yaml_values(Path(config_path), by_field)
        values.update(yaml_values)
        origin.update({k: f"{config_path}: {k[1]}" for k in yaml_values})
    for dest, value in vars(namespace).items():
        if dest == "config":
            continue
        slice_name, field = dest.split(".", 1)
        values[(slice_name, field)] = value
        origin[(slice_name, field)] = "--" + field.replace("_", "-")
    _apply_custom_config(values, origin, by_field)
    return build_config(values, origin, sglang + sglang_cli)


def _check_spec_first(argv: Sequence[str]) -> None:
    """A script whose layers come from a slime plugin spec tether does not build is refused for that
    first, naming the module: its other model flags (gated attention, ...) follow from those layers."""
    for i, arg in enumerate(argv):
        if arg == "--spec":
            values = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i + 1 :]))
            check_layer_spec(values)


def _apply_custom_config(
    values: dict[tuple[str, str], Any],
    origin: dict[tuple[str, str], str],
    by_field: dict[str, list[FlagSpec]],
) -> None:
    """--custom-config-path: a key naming a flag sets it, over the command line (slime sets every key on
    its args after parsing); a key naming a slime flag tether refuses is refused; other keys are left
    for the hooks' `args` (tether.runtime.custom_config)."""
    path = values.get(("algorithm", "custom_config_path"))
    if not path:
        return
    for key, value in read_custom_config(path).items():
        specs = by_field.get(key)
        if specs:
            values[(specs[0].slice, key)] = value
            origin[(specs[0].slice, key)] = f"--custom-config-path {path}: {key}"
            continue
        why = refusal("--" + key.replace("_", "-"))
        if why is not None:
            raise ConfigError(f"--custom-config-path {path}: {key}", value, why)
        if key.startswith("sglang_"):  # slime would pass it to SGLang; tether passes --sglang-* flags only
            raise ConfigError(
                f"--custom-config-path {path}: {key}",
                value,
                "names an SGLang flag; give it as --" + key.replace("_", "-") + " or in --config",
            )


def build_config(
    values: dict[tuple[str, str], Any],
    origin: dict[tuple[str, str], str] | None = None,
    sglang_args: list[str] | None = None,
) -> Config:
    """A Config from (slice, field) → value, converting strings and checking every slice."""
    origin = origin or {}
    values = _slime_buffer_example(_slime_fully_async(values))
    per_slice: dict[str, dict[str, Any]] = {name: {} for name in SLICES}
    for (slice_name, field), value in values.items():
        per_slice[slice_name][field] = value
    built: dict[str, Any] = {}
    for slice_name, cls in SLICES.items():
        data = per_slice[slice_name]
        try:
            built[slice_name] = msgspec.convert(data, cls, strict=False)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, ConfigError):
                raise exc.__cause__ from None
            match = re.search(r"at `\$\.(\w+)", str(exc))
            if match is None:
                raise ConfigError(slice_name, data, str(exc)) from None
            name = match.group(1)
            key = origin.get((slice_name, name), "--" + name.replace("_", "-"))
            reason = str(exc).split(" - at ")[0]
            raise ConfigError(key, data.get(name), reason) from None
    built["megatron"] = _with_train_iters(built["megatron"], built["data"])
    return Config(**built, sglang_args=list(sglang_args or []))


def help_text() -> str:
    parser = argparse.ArgumentParser(prog="tether run", add_help=False)
    add_config_arguments(parser)
    return parser.format_help()

"""The trainer's configuration slices: the RL algorithm, and the Megatron flags passed to Megatron.

Flag names and defaults follow slime (and, for Megatron's own flags, Megatron's defaults), so a slime
launch script parses unchanged. Model-architecture flags are accepted as optional values; where a
script sets them, the model builder checks them against the Hugging Face config.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tether.runtime.errors import ConfigError

AdvantageEstimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossType = Literal["policy_loss", "sft_loss", "custom_loss"]


# msgspec cannot put a numeric range on an optional (`T | None`) field, so these ranges are checked by
# hand in __post_init__: field -> (lowest allowed, whether the lowest itself is allowed, highest or None).
_OPTIONAL_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "eps_clip_high": (0.0, True, None),
    "save_interval": (1, True, None),
    "keep_last_checkpoints": (1, True, None),
    "keep_every_checkpoints": (1, True, None),
    "expert_tensor_parallel_size": (1, True, None),
    "lr_decay_iters": (1, True, None),
    "recompute_num_layers": (1, True, None),
    "num_layers": (1, True, None),
    "hidden_size": (1, True, None),
    "ffn_hidden_size": (1, True, None),
    "num_attention_heads": (1, True, None),
    "num_query_groups": (1, True, None),
    "kv_channels": (1, True, None),
    "vocab_size": (1, True, None),
    "make_vocab_size_divisible_by": (1, True, None),
    "max_position_embeddings": (1, True, None),
    "seq_length": (1, True, None),
    "rotary_base": (0.0, False, None),
    "rotary_percent": (0.0, False, 1.0),
    "norm_epsilon": (0.0, False, None),
}


def _check_optional_ranges(config: object) -> None:
    for name, (low, inclusive, high) in _OPTIONAL_RANGES.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value < low or (value == low and not inclusive):
            raise ConfigError(flag, value, f"must be {'>=' if inclusive else '>'} {low}")
        if high is not None and value > high:
            raise ConfigError(flag, value, f"must be <= {high}")


class AlgorithmConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The RL algorithm: advantage estimator, policy loss, KL, entropy, TIS, loss reduction, checkpoints."""

    advantage_estimator: Annotated[
        AdvantageEstimator, Meta(description="How rewards become per-token advantages.")
    ] = "grpo"
    loss_type: Annotated[
        LossType, Meta(description="policy_loss (PPO-style RL), sft_loss (supervised), or custom_loss.")
    ] = "policy_loss"
    custom_loss_function_path: Annotated[
        str | None, Meta(description="module.path:function computing the loss when --loss-type custom_loss.")
    ] = None
    eps_clip: Annotated[float, Meta(ge=0.0, description="PPO clip range below 1 (ratio >= 1 - eps).")] = 0.2
    eps_clip_high: Annotated[
        float | None, Meta(description="PPO clip range above 1; defaults to --eps-clip.")
    ] = None
    eps_clip_c: Annotated[
        float | None, Meta(description="Dual-clip PPO bound for negative advantages; must be > 1.")
    ] = None
    use_kl_loss: Annotated[bool, Meta(description="Add a KL(policy || reference) term to the loss.")] = False
    kl_loss_coef: Annotated[float, Meta(ge=0.0, description="Weight of the KL loss term.")] = 0.0
    kl_loss_type: Annotated[
        KlType, Meta(description="KL estimator for the KL loss and KL reward shaping.")
    ] = "k1"
    use_unbiased_kl: Annotated[
        bool, Meta(description="Weight the KL loss by the importance ratio pi/pi_old (unbiased off-policy).")
    ] = False
    kl_coef: Annotated[
        float,
        Meta(ge=0.0, description="KL penalty folded into the rewards before advantages (reward shaping)."),
    ] = 0.0
    entropy_coef: Annotated[float, Meta(ge=0.0, description="Weight of the entropy bonus.")] = 0.0
    use_rollout_logprobs: Annotated[
        bool, Meta(description="Use the engine's log-probs as the old policy in the PPO ratio.")
    ] = False
    use_tis: Annotated[
        bool, Meta(description="Truncated importance sampling between trainer and engine log-probs.")
    ] = False
    tis_clip: Annotated[float, Meta(gt=0.0, description="Upper bound of the TIS weight.")] = 2.0
    tis_clip_low: Annotated[float, Meta(ge=0.0, description="Lower bound of the TIS weight.")] = 0.0
    normalize_advantages: Annotated[
        bool, Meta(description="Whiten advantages over the step's trainable tokens (across DP ranks).")
    ] = False
    disable_grpo_std_normalization: Annotated[
        bool, Meta(description="GRPO: subtract the group mean only, do not divide by the std (Dr. GRPO).")
    ] = False
    disable_rewards_normalization: Annotated[
        bool, Meta(description="Use raw rewards: no group-mean baseline for grpo/gspo/reinforce++-baseline.")
    ] = False
    gamma: Annotated[float, Meta(ge=0.0, le=1.0, description="Discount for reinforce_plus_plus returns.")] = (
        1.0
    )
    lambd: Annotated[
        float,
        Meta(ge=0.0, le=1.0, description="GAE lambda (slime's critic path; no tether estimator uses it)."),
    ] = 1.0
    per_rollout_loss_mean: Annotated[
        bool,
        Meta(
            description="Average the loss per rollout (all segments of one rollout_id) then over rollouts, "
            "instead of over all trainable tokens of the step."
        ),
    ] = False
    lr: Annotated[float, Meta(ge=0.0, description="Peak learning rate.")] = 1e-6
    ref_load: Annotated[
        str | None,
        Meta(description="Checkpoint of the frozen reference model (KL); defaults to the start model."),
    ] = None
    load: Annotated[str | None, Meta(description="Checkpoint directory to resume training from.")] = None
    save: Annotated[str | None, Meta(description="Directory to save checkpoints into.")] = None
    save_interval: Annotated[int | None, Meta(description="Save a checkpoint every N rollouts.")] = None
    keep_last_checkpoints: Annotated[
        int | None,
        Meta(
            description="Keep the newest N complete checkpoints under --save, delete older ones "
            "(default: keep all)."
        ),
    ] = None
    keep_every_checkpoints: Annotated[
        int | None,
        Meta(
            description="Also keep iter_S when S+1 is a multiple of K (steps counted as --save-interval "
            "counts them); set alone, only those and the newest are kept."
        ),
    ] = None
    seed: Annotated[int, Meta(description="Random seed of the trainer.")] = 1234

    def __post_init__(self) -> None:
        _check_optional_ranges(self)
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ConfigError("--eps-clip-c", self.eps_clip_c, "the dual-clip bound must be greater than 1")
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ConfigError(
                "--custom-loss-function-path",
                self.custom_loss_function_path,
                "is required by --loss-type custom_loss",
            )
        if self.kl_coef != 0 and self.kl_loss_coef != 0:
            raise ConfigError(
                "--kl-coef", self.kl_coef, f"set either it or --kl-loss-coef (={self.kl_loss_coef}), not both"
            )
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise ConfigError("--kl-loss-coef", self.kl_loss_coef, "has no effect without --use-kl-loss")
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ConfigError(
                "--advantage-estimator",
                self.advantage_estimator,
                "REINFORCE++ estimators need --normalize-advantages (the advantages are whitened)",
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ConfigError(
                "--use-tis", True, "contradicts --use-rollout-logprobs (the TIS weight would always be 1)"
            )
        if self.tis_clip_low > self.tis_clip:
            raise ConfigError("--tis-clip-low", self.tis_clip_low, f"exceeds --tis-clip={self.tis_clip}")
        if self.save_interval is not None and self.save is None:
            raise ConfigError(
                "--save-interval", self.save_interval, "needs --save (where to write checkpoints)"
            )
        for flag, keep in (
            ("--keep-last-checkpoints", self.keep_last_checkpoints),
            ("--keep-every-checkpoints", self.keep_every_checkpoints),
        ):
            if keep is not None and self.save is None:
                raise ConfigError(flag, keep, "needs --save (the directory whose checkpoints it prunes)")
        every, interval = self.keep_every_checkpoints, self.save_interval
        if every is not None and interval is not None and every % interval:
            # Interval saves land where (S+1) % interval == 0, so only every lcm-th one would be kept.
            raise ConfigError(
                "--keep-every-checkpoints",
                every,
                f"must be a multiple of --save-interval={interval} (checkpoints exist only at its multiples)",
            )

    @property
    def clip_high(self) -> float:
        """The upper PPO clip range, resolved (slime: --eps-clip-high defaults to --eps-clip)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_ref_log_probs(self) -> bool:
        """Whether a step needs the frozen reference model's log-probs."""
        return self.use_kl_loss or self.kl_coef != 0


# The Megatron flags a slime launch script passes that describe the model. They are accepted here and,
# where set, checked against the HF config by the model builder (see `MegatronConfig.architecture`).
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "max_position_embeddings",
    "seq_length",
    "rotary_base",
    "rotary_percent",
    "norm_epsilon",
    "normalization",
    "swiglu",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "use_rotary_position_embeddings",
    "position_embedding_type",
    "attention_backend",
    "attention_softmax_in_fp32",
    "no_rope_fusion",
    "no_masked_softmax_fusion",
    "no_gradient_accumulation_fusion",
)


class MegatronConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Megatron-core flags tether passes to Megatron: parallelism, optimizer, precision, recompute, model."""

    tensor_model_parallel_size: Annotated[int, Meta(ge=1, description="Tensor-parallel size (TP).")] = 1
    pipeline_model_parallel_size: Annotated[int, Meta(ge=1, description="Pipeline-parallel size (PP).")] = 1
    context_parallel_size: Annotated[int, Meta(ge=1, description="Context-parallel size (CP).")] = 1
    expert_model_parallel_size: Annotated[
        int, Meta(ge=1, description="Expert-parallel size (MoE); tether trains dense models, so 1.")
    ] = 1
    expert_tensor_parallel_size: Annotated[
        int | None,
        Meta(description="Tensor-parallel size inside experts (MoE); dense models: unset or 1."),
    ] = None
    sequence_parallel: Annotated[bool, Meta(description="Megatron sequence parallelism (needs TP > 1).")] = (
        False
    )
    use_distributed_optimizer: Annotated[
        bool, Meta(description="Shard optimizer state across data-parallel ranks.")
    ] = False
    optimizer: Annotated[Literal["adam", "sgd"], Meta(description="Optimizer.")] = "adam"
    weight_decay: Annotated[float, Meta(ge=0.0, description="Weight decay.")] = 0.01
    adam_beta1: Annotated[float, Meta(ge=0.0, lt=1.0, description="Adam beta1.")] = 0.9
    adam_beta2: Annotated[float, Meta(ge=0.0, lt=1.0, description="Adam beta2.")] = 0.999
    adam_eps: Annotated[float, Meta(gt=0.0, description="Adam epsilon.")] = 1e-8
    clip_grad: Annotated[
        float, Meta(ge=0.0, description="Clip gradients to this global L2 norm (0: off).")
    ] = 1.0
    lr_decay_style: Annotated[
        Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        Meta(description="Learning-rate decay schedule."),
    ] = "linear"
    lr_decay_iters: Annotated[int | None, Meta(description="Steps over which the LR decays.")] = None
    min_lr: Annotated[float, Meta(ge=0.0, description="Lowest learning rate of the schedule.")] = 0.0
    lr_warmup_iters: Annotated[int, Meta(ge=0, description="Linear LR warm-up steps.")] = 0
    bf16: Annotated[bool, Meta(description="Train in bfloat16 (mixed precision).")] = False
    fp16: Annotated[bool, Meta(description="Train in float16 (mixed precision).")] = False
    attention_dropout: Annotated[
        float,
        Meta(
            ge=0.0,
            lt=1.0,
            description="Dropout on attention probs (0: trainer log-probs match the engine's).",
        ),
    ] = 0.0
    hidden_dropout: Annotated[float, Meta(ge=0.0, lt=1.0, description="Dropout on hidden states.")] = 0.0
    recompute_granularity: Annotated[
        Literal["full", "selective"] | None, Meta(description="Activation recomputation granularity.")
    ] = None
    recompute_method: Annotated[
        Literal["uniform", "block"] | None, Meta(description="How full recomputation divides the layers.")
    ] = None
    recompute_num_layers: Annotated[
        int | None,
        Meta(description="Layers per recompute unit (uniform) or recomputed layers (block)."),
    ] = None
    accumulate_allreduce_grads_in_fp32: Annotated[
        bool, Meta(description="Accumulate and all-reduce gradients in float32.")
    ] = False
    calculate_per_token_loss: Annotated[
        bool,
        Meta(description="slime's switch for a per-token loss mean; tether's default already is one."),
    ] = False

    # Model architecture (accepted so slime scripts parse; checked against the HF config where set).
    num_layers: Annotated[int | None, Meta(description="Transformer layers.")] = None
    hidden_size: Annotated[int | None, Meta(description="Hidden size.")] = None
    ffn_hidden_size: Annotated[int | None, Meta(description="MLP intermediate size.")] = None
    num_attention_heads: Annotated[int | None, Meta(description="Attention heads.")] = None
    num_query_groups: Annotated[int | None, Meta(description="Key/value heads (GQA groups).")] = None
    group_query_attention: Annotated[bool, Meta(description="Use grouped-query attention.")] = False
    kv_channels: Annotated[int | None, Meta(description="Attention head dimension.")] = None
    vocab_size: Annotated[int | None, Meta(description="Tokenizer vocabulary size.")] = None
    make_vocab_size_divisible_by: Annotated[
        int | None, Meta(description="Pad the embedding rows to a multiple of this (times TP).")
    ] = None
    max_position_embeddings: Annotated[
        int | None, Meta(description="Longest position the model supports.")
    ] = None
    seq_length: Annotated[int | None, Meta(description="Training sequence length.")] = None
    rotary_base: Annotated[float | None, Meta(description="RoPE base (theta).")] = None
    rotary_percent: Annotated[
        float | None, Meta(description="Fraction of the head dim that RoPE rotates.")
    ] = None
    norm_epsilon: Annotated[float | None, Meta(description="Epsilon of the normalization layers.")] = None
    normalization: Annotated[
        Literal["LayerNorm", "RMSNorm"] | None, Meta(description="Normalization layer.")
    ] = None
    swiglu: Annotated[bool, Meta(description="SwiGLU MLP.")] = False
    disable_bias_linear: Annotated[bool, Meta(description="No biases in linear layers.")] = False
    add_qkv_bias: Annotated[bool, Meta(description="Bias in the QKV projection (Qwen2).")] = False
    qk_layernorm: Annotated[bool, Meta(description="Normalize queries and keys per head (Qwen3).")] = False
    untie_embeddings_and_output_weights: Annotated[
        bool, Meta(description="Separate input embedding and output layer weights.")
    ] = False
    use_rotary_position_embeddings: Annotated[bool, Meta(description="Rotary position embeddings.")] = False
    position_embedding_type: Annotated[
        Literal["learned_absolute", "rope", "mrope", "relative", "none"] | None,
        Meta(description="Position embedding type."),
    ] = None
    attention_backend: Annotated[
        Literal["flash", "fused", "unfused", "local", "auto"] | None,
        Meta(description="Attention kernel (Megatron's choice on GPU; tether uses local on CPU)."),
    ] = None
    attention_softmax_in_fp32: Annotated[bool, Meta(description="Compute attention softmax in float32.")] = (
        False
    )
    no_rope_fusion: Annotated[bool, Meta(description="Disable the fused RoPE kernel.")] = False
    no_masked_softmax_fusion: Annotated[bool, Meta(description="Disable the fused masked softmax.")] = False
    no_gradient_accumulation_fusion: Annotated[
        bool, Meta(description="Disable fused gradient accumulation (needs APEX/TE otherwise).")
    ] = False

    def __post_init__(self) -> None:
        _check_optional_ranges(self)
        if self.bf16 and self.fp16:
            raise ConfigError("--fp16", True, "contradicts --bf16; choose one precision")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("--sequence-parallel", True, "needs --tensor-model-parallel-size > 1")
        if self.expert_model_parallel_size != 1:
            raise ConfigError(
                "--expert-model-parallel-size",
                self.expert_model_parallel_size,
                "tether trains dense models only",
            )
        if self.expert_tensor_parallel_size not in (None, 1):
            raise ConfigError(
                "--expert-tensor-parallel-size",
                self.expert_tensor_parallel_size,
                "tether trains dense models only",
            )
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ConfigError(
                "--recompute-method", self.recompute_method, "applies only with --recompute-granularity full"
            )
        if self.recompute_granularity == "full" and (
            self.recompute_method is None or not self.recompute_num_layers
        ):
            raise ConfigError(
                "--recompute-granularity",
                "full",
                "needs --recompute-method (uniform|block) and --recompute-num-layers",
            )
        if self.num_query_groups is not None and self.num_attention_heads is not None:
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError(
                    "--num-query-groups",
                    self.num_query_groups,
                    f"must divide --num-attention-heads={self.num_attention_heads}",
                )
        if (
            self.num_attention_heads is not None
            and self.num_attention_heads % self.tensor_model_parallel_size
        ):
            raise ConfigError(
                "--num-attention-heads",
                self.num_attention_heads,
                f"must be divisible by --tensor-model-parallel-size={self.tensor_model_parallel_size}",
            )
        if self.num_layers is not None and self.num_layers % self.pipeline_model_parallel_size:
            raise ConfigError(
                "--num-layers",
                self.num_layers,
                f"must be divisible by --pipeline-model-parallel-size={self.pipeline_model_parallel_size}",
            )
        if self.min_lr < 0:
            raise ConfigError("--min-lr", self.min_lr, "must be >= 0")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one model replica (TP x PP x CP)."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for a trainer job of `world_size` ranks; raises ConfigError when it does not divide."""
        if world_size % self.model_parallel_size:
            raise ConfigError(
                "--tensor-model-parallel-size",
                self.tensor_model_parallel_size,
                f"TP x PP x CP = {self.model_parallel_size} must divide the {world_size} trainer ranks",
            )
        return world_size // self.model_parallel_size

    def architecture(self) -> dict[str, object]:
        """The architecture flags the user set (non-default), for the model builder to check against HF."""
        out: dict[str, object] = {}
        for name in ARCHITECTURE_FIELDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                out[name] = value
        return out


def check_algorithm_against_megatron(algorithm: AlgorithmConfig, megatron: MegatronConfig) -> None:
    """Contradictions between the two trainer slices (for the composite config's cross-slice checks)."""
    if megatron.calculate_per_token_loss and algorithm.per_rollout_loss_mean:
        raise ConfigError(
            "--calculate-per-token-loss",
            True,
            "contradicts --per-rollout-loss-mean; choose one loss reduction",
        )

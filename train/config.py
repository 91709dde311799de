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
from tether.train.state.checks import check_trainer_state_flags

AdvantageEstimator = Literal[
    "grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossType = Literal["policy_loss", "sft_loss", "custom_loss"]


# msgspec cannot put a numeric range on an optional (`T | None`) field, so these ranges are checked by
# hand in __post_init__: field -> (lowest allowed, whether the lowest itself is allowed, highest or None).
_OPTIONAL_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "eps_clip_high": (0.0, True, None),
    "log_probs_max_tokens_per_gpu": (1, True, None),
    "save_interval": (1, True, None),
    "ckpt_step": (0, True, None),
    "ref_ckpt_step": (0, True, None),
    "keep_last_checkpoints": (1, True, None),
    "keep_every_checkpoints": (1, True, None),
    "expert_tensor_parallel_size": (1, True, None),
    "data_pad_size_multiplier": (1, True, None),
    "lr_decay_iters": (1, True, None),
    "ref_update_interval": (1, True, None),
    "train_iters": (1, True, None),
    "lr_warmup_fraction": (0.0, True, 1.0),
    "lr_wsd_decay_iters": (1, True, None),
    "loss_scale": (0.0, False, None),
    "recompute_num_layers": (1, True, None),
    "decoder_first_pipeline_num_layers": (1, True, None),
    "decoder_last_pipeline_num_layers": (1, True, None),
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
    "num_experts": (1, True, None),
    "moe_router_topk": (1, True, None),
    "moe_ffn_hidden_size": (1, True, None),
    "moe_shared_expert_intermediate_size": (1, True, None),
    "moe_router_topk_scaling_factor": (0.0, False, None),
    "moe_router_num_groups": (1, True, None),
    "moe_router_group_topk": (1, True, None),
    "q_lora_rank": (1, True, None),
    "kv_lora_rank": (1, True, None),
    "qk_head_dim": (1, True, None),
    "qk_pos_emb_head_dim": (1, True, None),
    "v_head_dim": (1, True, None),
    "rotary_scaling_factor": (0.0, False, None),
    "mscale": (0.0, False, None),
    "mscale_all_dim": (0.0, False, None),
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
    custom_reward_post_process_path: Annotated[
        str | None,
        Meta(
            description="Replace the reward post-processing (group normalisation for grpo): "
            "`fn(args, samples) -> (raw_rewards, rewards)` over a rollout's samples, as slime calls it."
        ),
    ] = None
    custom_advantage_function_path: Annotated[
        str | None,
        Meta(
            description="Replace the advantage estimator: `fn(args, rollout_data)` sets rollout_data['advantages'] "
            "and ['returns'] (per sample, a tensor per response token) from its rewards, log-probs, loss masks "
            "and kl, as in slime; --normalize-advantages still whitens them after."
        ),
    ] = None
    custom_convert_samples_to_train_data_path: Annotated[
        str | None,
        Meta(
            description="Replace the conversion of a rollout's samples into training data: "
            "`fn(args, samples) -> dict` with slime's keys (tokens, response_lengths, rewards, loss_masks; "
            "optionally raw_reward, rollout_ids, sample_indices, rollout_log_probs, truncated, "
            "rollout_mask_sums), one entry per training sample; replaces the reward post-processing too."
        ),
    ] = None
    rollout_data_postprocess_path: Annotated[
        str | None,
        Meta(
            description="Each step, after the log-prob passes and the advantages: `fn(args, rollout_id, "
            "rollout_data)` per data-parallel shard, on slime's rollout_data dict; what it changes in "
            "loss_masks, advantages, log_probs, ref_log_probs and rollout_log_probs is what trains."
        ),
    ] = None
    disable_compute_advantages_and_returns: Annotated[
        bool,
        Meta(
            description="Compute no advantages, old or reference log-probs (slime's meaning: for --loss-type "
            "sft_loss or custom_loss)."
        ),
    ] = False
    eps_clip: Annotated[float, Meta(ge=0.0, description="PPO clip range below 1 (ratio >= 1 - eps).")] = 0.2
    eps_clip_high: Annotated[
        float | None, Meta(description="PPO clip range above 1; defaults to --eps-clip.")
    ] = None
    eps_clip_c: Annotated[
        float | None, Meta(description="Dual-clip PPO bound for negative advantages; must be > 1.")
    ] = None
    use_opsm: Annotated[
        bool,
        Meta(
            description="Off-policy sequence masking (slime's OPSM): a sequence with a negative advantage "
            "whose masked mean of (old - new) log-prob exceeds --opsm-delta gets no policy-gradient loss."
        ),
    ] = False
    opsm_delta: Annotated[
        float | None,
        Meta(
            description="OPSM's threshold on a sequence's mean (old - new) log-prob (slime's default 1e-4)."
        ),
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
    use_routing_replay: Annotated[
        bool,
        Meta(
            description="MoE routing replay (R2, arXiv 2507.18071): the training forward of a step routes each "
            "token to the experts the actor's log-prob forward of that step chose (MoE models only)."
        ),
    ] = False
    use_rollout_routing_replay: Annotated[
        bool,
        Meta(
            description="Rollout routing replay (R3, arXiv 2510.11370): every trainer forward of the actor routes "
            "each token to the experts the rollout engine routed it to (MoE models; implies "
            "--use-routing-replay)."
        ),
    ] = False
    tis_clip_low: Annotated[float, Meta(ge=0.0, description="Lower bound of the TIS weight.")] = 0.0
    custom_tis_function_path: Annotated[
        str | None,
        Meta(
            description="Replace the built-in TIS (with --use-tis or --get-mismatch-metrics): "
            "`fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, "
            "response_lengths) -> (pg_loss, modified_response_masks, metrics)`, as slime calls it "
            "(e.g. slime's examples/train_infer_mismatch_helper/mis.py)."
        ),
    ] = None
    get_mismatch_metrics: Annotated[
        bool,
        Meta(
            description="Run --custom-tis-function-path on every step for its train/rollout mismatch "
            "metrics (and the `ois` ratio), even without --use-tis; the actor's log-prob pass runs before "
            "every step for it (needs the engines' log-probs)."
        ),
    ] = False
    custom_pg_loss_reducer_function_path: Annotated[
        str | None,
        Meta(
            description="Reduce the per-token policy-gradient loss with "
            "`fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer`, "
            "reducer(pg_loss) -> scalar, as slime calls it (other terms and metrics keep the default)."
        ),
    ] = None
    use_rollout_entropy: Annotated[
        bool,
        Meta(
            description="Compute the entropy in the actor's and reference's log-prob passes too "
            "(logged as rollout/entropy, rollout/ref_entropy)."
        ),
    ] = False
    log_probs_chunk_size: Annotated[
        int,
        Meta(
            description="Compute log-probs and entropy over at most this many tokens at a time to bound the "
            "memory of the vocabulary-wide intermediates (-1: all tokens of a micro-batch at once)."
        ),
    ] = -1
    recompute_loss_function: Annotated[
        bool,
        Meta(
            description="Recompute the training loss from the logits in the backward pass "
            "(torch.utils.checkpoint, as slime does) instead of keeping its vocabulary-wide "
            "intermediates between forward and backward: less memory, the same gradients."
        ),
    ] = False
    log_probs_max_tokens_per_gpu: Annotated[
        int | None,
        Meta(
            description="Token budget of a micro-batch in the log-prob passes (with --use-dynamic-batch-size; "
            "default --max-tokens-per-gpu)."
        ),
    ] = None
    custom_config_path: Annotated[
        str | None,
        Meta(
            description="YAML whose keys become attributes of the `args` every hook gets (slime's meaning); "
            "a key naming a flag sets that flag, overriding the command line."
        ),
    ] = None
    normalize_advantages: Annotated[
        bool, Meta(description="Whiten advantages over the step's trainable tokens (across DP ranks).")
    ] = False
    disable_grpo_std_normalization: Annotated[
        bool, Meta(description="GRPO: subtract the group mean only, do not divide by the std (Dr. GRPO).")
    ] = False
    disable_rewards_normalization: Annotated[
        bool, Meta(description="Use raw rewards: no group-mean baseline for grpo/gspo/reinforce++-baseline.")
    ] = False
    gamma: Annotated[
        float, Meta(ge=0.0, le=1.0, description="Discount of reinforce_plus_plus returns and of ppo's GAE.")
    ] = 1.0
    lambd: Annotated[
        float,
        Meta(
            ge=0.0,
            le=1.0,
            description="GAE lambda of advantage estimator ppo (the critic's); other estimators take none.",
        ),
    ] = 1.0
    value_clip: Annotated[
        float,
        Meta(description="ppo: the critic's value loss clips new values to old values +- this (slime's)."),
    ] = 0.2
    num_critic_only_steps: Annotated[
        int,
        Meta(
            ge=0,
            description="ppo: the first N rollouts train the critic only, the actor from rollout N on.",
        ),
    ] = 0
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
        Meta(
            description="Checkpoint of the frozen reference model (KL): a Megatron checkpoint directory "
            "(e.g. slime's HF->torch_dist conversion) or an HF model directory; without it the reference "
            "is --hf-checkpoint. As in slime, also the actor's start weights (fresh run) when --load "
            "holds no checkpoint."
        ),
    ] = None
    load: Annotated[
        str | None,
        Meta(
            description="Checkpoint to resume training from: a Megatron checkpoint directory "
            "(latest_checkpointed_iteration.txt naming iter_XXXXXXX/ or release/, one such directory "
            "itself, or tether's older `latest` layout); or an HF model directory to start a fresh run "
            "from. When it holds neither, the actor starts from --ref-load (slime's rule)."
        ),
    ] = None
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
    # Megatron's checkpoint flags as slime passes them (tether.train.checkpoint.load_save applies them).
    no_save_optim: Annotated[
        bool,
        Meta(
            description="Save checkpoints without the optimizer state (and LR schedule); a resume from one "
            "starts a fresh optimizer (Megatron's meaning)."
        ),
    ] = False
    no_load_optim: Annotated[
        bool,
        Meta(
            description="Resume without the checkpoint's optimizer state and LR schedule: a fresh optimizer, "
            "the run position still restored."
        ),
    ] = False
    no_load_rng: Annotated[
        bool, Meta(description="Resume without the checkpoint's RNG states (they stay as seeded).")
    ] = False
    finetune: Annotated[
        bool,
        Meta(
            description="Load --load's weights only: no optimizer, LR schedule, RNG or run position; the "
            "iteration is reset to 0 (Megatron's --finetune) and, from a Megatron checkpoint in --load, "
            "the run starts at rollout 1 (slime: the loaded iteration + 1)."
        ),
    ] = False
    ckpt_step: Annotated[
        int | None,
        Meta(
            description="Load iter_N of --load instead of the one its tracker names (Megatron/slime; 0 means "
            "the tracker's, as there). Also --ref-load's step when --ref-ckpt-step is unset (slime)."
        ),
    ] = None
    ref_ckpt_step: Annotated[
        int | None, Meta(description="Load iter_N of --ref-load instead of the one its tracker names.")
    ] = None
    async_save: Annotated[
        bool,
        Meta(
            description="Write checkpoints in the background: the step returns once the tensors are copied; "
            "the checkpoint is finalised (made complete and named by the tracker) before the next save, "
            "the next weight update and the trainer's exit."
        ),
    ] = False
    seed: Annotated[int, Meta(description="Random seed of the trainer.")] = 1234
    ref_update_interval: Annotated[
        int | None,
        Meta(
            description="Every N rollouts the reference model's weights become the actor's (slime: once "
            "rollout r has trained, when r + 1 is a multiple of N); needs a reference model (--use-kl-loss or "
            "--kl-coef)."
        ),
    ] = None
    reset_optimizer_states: Annotated[
        bool,
        Meta(
            description="Clear the optimizer's history before each rollout's training, as slime does: Adam's "
            "moments (exp_avg, exp_avg_sq) zeroed and its step count reset to 0."
        ),
    ] = False
    keep_old_actor: Annotated[
        bool,
        Meta(
            description="Keep a copy of the actor as the weights the engines generated with (slime's "
            "old_actor) and compute the old log-probs with it; it follows each weight update (with "
            "--update-weights-interval 1 one update behind, for the one-step-off async loop)."
        ),
    ] = False
    only_train_params_name_list: Annotated[
        list[str] | None,
        Meta(
            description="Regex patterns (re.search) of Megatron parameter names to train, e.g. "
            "'decoder.layers.1.mlp' or 'output_layer'; every other parameter is frozen (no gradient, no "
            "optimizer state)."
        ),
    ] = None
    freeze_params_name_list: Annotated[
        list[str] | None,
        Meta(
            description="Regex patterns (re.search) of Megatron parameter names to freeze (no gradient, no "
            "optimizer state), e.g. 'embedding' or 'linear_fc1'; the others train."
        ),
    ] = None
    freeze_indexer: Annotated[
        bool,
        Meta(
            description="Freeze the DeepSeek sparse-attention indexers (GLM-5, DeepSeek-V3.2: wq_b, wk, "
            "k_norm, weights_proj): no optimizer step and no weight decay on them (they get no gradient "
            "either way); refused for a model without indexers."
        ),
    ] = False
    use_opd: Annotated[
        bool,
        Meta(
            description="On-policy distillation (slime's OPD): subtract --opd-kl-coef x (student - teacher "
            "log-prob of each sampled response token) from the advantages, on top of any estimator; "
            "needs --opd-type."
        ),
    ] = False
    opd_type: Annotated[
        Literal["sglang", "megatron"] | None,
        Meta(
            description="Where the teacher's log-probs come from: 'sglang': the Samples carry them from an "
            "external SGLang teacher server queried during the rollout (slime.rollout.on_policy_distillation "
            "hooks); 'megatron': a teacher model with the actor's architecture that the trainer ranks load "
            "from --opd-teacher-load."
        ),
    ] = None
    opd_kl_coef: Annotated[float, Meta(description="Weight of the on-policy distillation KL penalty.")] = 1.0
    opd_teacher_load: Annotated[
        str | None,
        Meta(
            description="The teacher's checkpoint for --opd-type megatron (required there, refused "
            "otherwise): a Megatron checkpoint directory or an HF model directory, of the actor's "
            "architecture."
        ),
    ] = None
    opd_teacher_ckpt_step: Annotated[
        int | None,
        Meta(description="Load the teacher from iter_<step> of --opd-teacher-load instead of its latest."),
    ] = None
    custom_model_provider_path: Annotated[
        str | None,
        Meta(
            description="Build each model chunk with `fn(pre_process=, post_process=[, vp_stage=None][, config=])` "
            "instead of tether's GPTModel, as slime calls it (`config`: tether's TransformerConfig, when the "
            "function takes it); HF weights still load through the bridge, by Megatron parameter name."
        ),
    ] = None
    custom_megatron_init_path: Annotated[
        str | None,
        Meta(
            description="Call `fn(args)` on every trainer rank once Megatron is initialised, before models are "
            "built."
        ),
    ] = None
    custom_megatron_before_log_prob_hook_path: Annotated[
        str | None,
        Meta(
            description="Call `fn(args, model, store_prefix)` before every forward-only pass (log-probs: "
            "'' actor, 'ref_' reference, 'teacher_' teacher; the critic's values: '')."
        ),
    ] = None
    custom_megatron_before_train_step_hook_path: Annotated[
        str | None,
        Meta(
            description="Call `fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)` before every "
            "optimizer step's forward/backward, after the gradients are zeroed."
        ),
    ] = None
    megatron_config_path: Annotated[
        str | None,
        Meta(
            description="slime's per-role YAML: `megatron: [{name, role: actor|critic, overrides: {key: value}}]`; "
            "each role's overrides (Megatron and optimizer flags, by argparse name) apply over the command line."
        ),
    ] = None

    def __post_init__(self) -> None:
        _check_optional_ranges(self)
        if self.use_rollout_routing_replay and not self.use_routing_replay:
            msgspec.structs.force_setattr(self, "use_routing_replay", True)  # slime: R3 implies R2
        if self.lambd != 1.0 and self.advantage_estimator != "ppo":
            raise ConfigError(
                "--lambd",
                self.lambd,
                "is GAE's lambda, used only by advantage estimator ppo (with its critic); "
                f"--advantage-estimator {self.advantage_estimator} takes no lambda",
            )
        if self.advantage_estimator != "ppo":
            # Critic-only settings without a critic would be accepted and do nothing.
            for flag, value, default in (
                ("--value-clip", self.value_clip, 0.2),
                ("--num-critic-only-steps", self.num_critic_only_steps, 0),
            ):
                if value != default:
                    raise ConfigError(
                        flag, value, "configures the critic, which only --advantage-estimator ppo has"
                    )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ConfigError("--eps-clip-c", self.eps_clip_c, "the dual-clip bound must be greater than 1")
        if self.opsm_delta is not None and not self.use_opsm:
            raise ConfigError("--opsm-delta", self.opsm_delta, "has no effect without --use-opsm")
        if self.use_opsm and self.loss_type != "policy_loss":
            # slime masks only its policy loss; another loss would take the flag and do nothing.
            raise ConfigError("--use-opsm", True, f"masks the policy loss; --loss-type is {self.loss_type}")
        if self.disable_compute_advantages_and_returns and self.loss_type == "policy_loss":
            raise ConfigError(
                "--disable-compute-advantages-and-returns",
                True,
                "leaves --loss-type policy_loss without the advantages it trains on; use sft_loss or custom_loss",
            )
        for flag, path in (
            ("--custom-reward-post-process-path", self.custom_reward_post_process_path),
            ("--custom-advantage-function-path", self.custom_advantage_function_path),
            ("--custom-convert-samples-to-train-data-path", self.custom_convert_samples_to_train_data_path),
            ("--rollout-data-postprocess-path", self.rollout_data_postprocess_path),
        ):
            if path is not None and "." not in path and ":" not in path:
                raise ConfigError(flag, path, "must be `package.module.function` or `file.py:function`")
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
        if self.get_mismatch_metrics and self.custom_tis_function_path is None:
            raise ConfigError(
                "--get-mismatch-metrics",
                True,
                "needs --custom-tis-function-path (the function computing them)",
            )
        for flag, hook_path in (
            ("--custom-tis-function-path", self.custom_tis_function_path),
            ("--custom-pg-loss-reducer-function-path", self.custom_pg_loss_reducer_function_path),
        ):
            if hook_path is not None and "." not in hook_path and ":" not in hook_path:
                raise ConfigError(flag, hook_path, "must be `package.module.function` or `file.py:function`")
        if (
            self.log_probs_max_tokens_per_gpu is not None
            and self.use_routing_replay
            and not self.use_rollout_routing_replay
        ):
            raise ConfigError(
                "--log-probs-max-tokens-per-gpu",
                self.log_probs_max_tokens_per_gpu,
                "contradicts --use-routing-replay: R2 replays in training the routing of the log-prob pass's "
                "micro-batches, which must then be the training ones (--max-tokens-per-gpu)",
            )
        if self.log_probs_chunk_size == 0 or self.log_probs_chunk_size < -1:
            raise ConfigError(
                "--log-probs-chunk-size", self.log_probs_chunk_size, "must be a positive token count, or -1"
            )
        if self.tis_clip_low > self.tis_clip:
            raise ConfigError("--tis-clip-low", self.tis_clip_low, f"exceeds --tis-clip={self.tis_clip}")
        if self.save_interval is not None and self.save is None:
            raise ConfigError(
                "--save-interval", self.save_interval, "needs --save (where to write checkpoints)"
            )
        for flag, on in (("--no-save-optim", self.no_save_optim), ("--async-save", self.async_save)):
            if on and self.save is None:
                raise ConfigError(flag, True, "needs --save (it changes how checkpoints are written)")
        if self.ref_ckpt_step is not None and self.ref_load is None:
            raise ConfigError("--ref-ckpt-step", self.ref_ckpt_step, "needs --ref-load (the step of which)")
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

        _check_opd(self)
        check_trainer_state_flags(self)

    @property
    def clip_high(self) -> float:
        """The upper PPO clip range, resolved (slime: --eps-clip-high defaults to --eps-clip)."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def opsm_threshold(self) -> float:
        """OPSM's threshold, resolved (slime's default 1e-4)."""
        return 1e-4 if self.opsm_delta is None else self.opsm_delta

    @property
    def needs_ref_log_probs(self) -> bool:
        """Whether a step needs the frozen reference model's log-probs."""
        return self.use_kl_loss or self.kl_coef != 0

    @property
    def records_routing_per_step(self) -> bool:
        """R2 routing replay (--use-routing-replay without R3): the actor's log-prob pass records
        the routing its training step replays, so that pass runs right before every step."""
        return self.use_routing_replay and not self.use_rollout_routing_replay


def _check_opd(cfg: AlgorithmConfig) -> None:
    """slime's checks of the on-policy distillation flags, and tether's: no OPD flag goes unused."""
    import os

    if not cfg.use_opd:
        for flag, value, default in (
            ("--opd-teacher-load", cfg.opd_teacher_load, None),
            ("--opd-type", cfg.opd_type, None),
            ("--opd-kl-coef", cfg.opd_kl_coef, 1.0),
            ("--opd-teacher-ckpt-step", cfg.opd_teacher_ckpt_step, None),
        ):
            if value != default:
                raise ConfigError(flag, value, "is set but --use-opd is not enabled: add --use-opd")
        return
    if cfg.opd_type is None:
        raise ConfigError("--opd-type", None, "must be set with --use-opd: 'sglang' or 'megatron'")
    if cfg.loss_type == "sft_loss" or cfg.disable_compute_advantages_and_returns:
        raise ConfigError("--use-opd", True, "changes advantages, which this run does not compute")
    if cfg.opd_type == "sglang":
        if cfg.opd_teacher_load is not None:
            raise ConfigError(
                "--opd-teacher-load",
                cfg.opd_teacher_load,
                "must not be set with --opd-type sglang (the teacher's log-probs come from its server "
                "during the rollout)",
            )
        if cfg.opd_teacher_ckpt_step is not None:
            raise ConfigError(
                "--opd-teacher-ckpt-step", cfg.opd_teacher_ckpt_step, "needs --opd-type megatron"
            )
        return
    load = cfg.opd_teacher_load
    if load is None:
        raise ConfigError(
            "--opd-teacher-load", None, "is required by --opd-type megatron (the teacher's checkpoint)"
        )
    if not os.path.isdir(load):
        raise ConfigError("--opd-teacher-load", load, "does not exist (or is not a directory)")
    from pathlib import Path

    from tether.train.checkpoint.layout import holds_megatron_checkpoint, is_hf_checkpoint

    step = cfg.opd_teacher_ckpt_step
    if step is None and not holds_megatron_checkpoint(Path(load)) and not is_hf_checkpoint(Path(load)):
        raise ConfigError(
            "--opd-teacher-load",
            load,
            "holds no Megatron checkpoint (latest_checkpointed_iteration.txt, iter_XXXXXXX/ or release/) "
            "and no HF model (config.json and safetensors)",
        )
    if step is not None:
        iteration = os.path.join(load, f"iter_{step:07d}")
        if step < 0 or not os.path.isdir(iteration):
            raise ConfigError(
                "--opd-teacher-ckpt-step", step, f"names no checkpoint: {iteration} does not exist"
            )


def stage_layers(
    num_layers: int, pp_size: int, first: int | None, last: int | None, *, layers_flag: str
) -> list[int]:
    """Transformer layers of each pipeline stage, Megatron's way: --decoder-first/last-pipeline-num-layers
    fix the first/last stage and the other layers split evenly over the stages between them.

    `layers_flag` names where `num_layers` came from (`--num-layers`, or the HF config) in errors.
    """
    if first is not None:
        blame: tuple[str, object] = ("--decoder-first-pipeline-num-layers", first)
    elif last is not None:
        blame = ("--decoder-last-pipeline-num-layers", last)
    elif layers_flag.startswith("--"):
        blame = (layers_flag, num_layers)
    else:
        blame = ("--pipeline-model-parallel-size", pp_size)
    fixed = [x for x in (first, last) if x is not None]
    rest_layers = num_layers - sum(fixed)
    rest_stages = pp_size - len(fixed)
    if rest_stages == 0:
        ok = rest_layers == 0
    else:
        ok = rest_layers >= rest_stages and rest_layers % rest_stages == 0
    if not ok:
        raise ConfigError(
            *blame,
            f"leaves {rest_layers} of {layers_flag}={num_layers} layers for the {rest_stages} of "
            f"--pipeline-model-parallel-size={pp_size} stages without a fixed count; they must split "
            "evenly, at least one layer per stage",
        )
    middle = [rest_layers // rest_stages] * rest_stages if rest_stages else []
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


# slime's plugin layer specs (Megatron-LM's --spec MODULE FUNCTION) tether builds natively.
BUILT_LAYER_SPECS: dict[tuple[str, str], str] = {
    # The GPT layer with the post-sublayer norms its own flags ask for, which tether builds for any family.
    ("slime_plugins.models.glm4", "get_glm_spec"): "GLM-4's layers",
    # Full QK norms; the Hugging Face config must be MiniMax-M2's (hf_config.check_architecture_flags).
    ("slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"): "MiniMax-M2's layers",
    # Gated-DeltaNet linear attention and gated full attention; the Hugging Face config must be
    # Qwen3-Next's (hf_config.check_architecture_flags). tether builds Megatron's GatedDeltaNet.
    ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): "Qwen3-Next's layers",
    # The same layers under Qwen3.5's checkpoint names, dense or MoE; the Hugging Face config must be
    # Qwen3.5's (hf_config.check_architecture_flags).
    ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"): "Qwen3.5's layers",
    # MLA with DeepSeek sparse attention's indexer; the Hugging Face config must be GLM-5's or
    # DeepSeek-V3.2's (hf_config.check_architecture_flags; tether.train.model.families.dsa).
    ("slime_plugins.models.glm5.glm5", "get_glm5_spec"): "GLM-5's / DeepSeek-V3.2's sparse-attention layers",
}
UNBUILT_LAYER_SPECS: dict[str, str] = {}


def check_layer_spec(spec: list[str]) -> None:
    """Accept `--spec` only where it names layers tether builds itself; refuse others by module."""
    value = " ".join(spec)
    if len(spec) != 2:
        raise ConfigError("--spec", value, "takes a module and a function name, as Megatron-LM's --spec")
    module, function = spec
    if (module, function) in BUILT_LAYER_SPECS:
        return
    why = UNBUILT_LAYER_SPECS.get(module, "tether builds the layers of each model family itself")
    raise ConfigError(
        "--spec",
        value,
        f"names the layer-spec plugin module {module!r}, which tether does not use: {why}; "
        f"accepted: {', '.join(' '.join(k) for k in BUILT_LAYER_SPECS)}",
    )


# The Megatron flags a slime launch script passes that describe the model. They are accepted here and,
# where set, checked against the HF config by the model builder (see `MegatronConfig.architecture`).
ARCHITECTURE_FIELDS: tuple[str, ...] = (
    "spec",
    "model_name",
    "num_layers",
    "mtp_num_layers",
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
    "rotary_interleaved",
    "norm_epsilon",
    "normalization",
    "swiglu",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "attention_output_gate",
    "use_gated_attention",
    "apply_layernorm_1p",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
    "untie_embeddings_and_output_weights",
    "use_rotary_position_embeddings",
    "position_embedding_type",
    "attention_backend",
    "attention_softmax_in_fp32",
    "no_rope_fusion",
    "no_masked_softmax_fusion",
    "no_gradient_accumulation_fusion",
    # Mixture of experts and multi-latent attention (Megatron's names): the checkpoint's shape too.
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_router_score_function",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_router_pre_softmax",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
)


class MegatronConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Megatron-core flags tether passes to Megatron: parallelism, optimizer, precision, recompute, model.

    Each flag reaches the Megatron config it belongs to (`tether.train.model.megatron_args` builds them) or
    is refused here, before any process starts, with the flag, the value and what is missing.
    """

    tensor_model_parallel_size: Annotated[int, Meta(ge=1, description="Tensor-parallel size (TP).")] = 1
    pipeline_model_parallel_size: Annotated[int, Meta(ge=1, description="Pipeline-parallel size (PP).")] = 1
    decoder_first_pipeline_num_layers: Annotated[
        int | None, Meta(description="Layers on the first pipeline stage (uneven stages; needs PP > 1).")
    ] = None
    decoder_last_pipeline_num_layers: Annotated[
        int | None, Meta(description="Layers on the last pipeline stage (uneven stages; needs PP > 1).")
    ] = None
    context_parallel_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Context-parallel size (CP): each micro-batch's sequence is split over this many "
            "ranks (Megatron's load-balanced chunks; TransformerEngine's attention on GPU, tether's "
            "key/value all-gather attention on the local spec).",
        ),
    ] = 1
    allgather_cp: Annotated[
        bool,
        Meta(
            description="slime's all-gather CP layout: each CP rank holds one contiguous share of every "
            "sequence (not Megatron's load-balanced chunks) and attention gathers the keys; for DeepSeek "
            "sparse-attention models (GLM-5, DeepSeek-V3.2) only, refused for others at CP > 1."
        ),
    ] = False
    expert_model_parallel_size: Annotated[
        int, Meta(ge=1, description="Expert-parallel size (MoE): the experts are split over this many ranks.")
    ] = 1
    expert_tensor_parallel_size: Annotated[
        int | None,
        Meta(description="Tensor-parallel size inside experts (MoE; default: --tensor-model-parallel-size)."),
    ] = None
    sequence_parallel: Annotated[
        bool,
        Meta(
            description="Megatron sequence parallelism (off at TP = 1, as Megatron does; MoE models at "
            "TP > 1 need it)."
        ),
    ] = False
    data_pad_size_multiplier: Annotated[
        int | None,
        Meta(
            description="Micro-batches are padded to a multiple of TP x this many positions (x CP: each "
            "context-parallel rank's share is; slime's pad_size, to reduce memory fragmentation). Unset: "
            "tether's own padding (to the longest sample) - slime's default 128 pads one packed stream, "
            "where tether would pad every row of its micro-batch grid.",
        ),
    ] = None
    use_distributed_optimizer: Annotated[
        bool, Meta(description="Shard optimizer state across data-parallel ranks.")
    ] = False
    overlap_grad_reduce: Annotated[
        bool, Meta(description="Overlap the data-parallel gradient reduction with the backward pass.")
    ] = False
    overlap_param_gather: Annotated[
        bool,
        Meta(
            description="Overlap the distributed optimizer's parameter all-gather with the next forward "
            "(needs --use-distributed-optimizer and --overlap-grad-reduce)."
        ),
    ] = False
    optimizer: Annotated[Literal["adam", "sgd"], Meta(description="Optimizer.")] = "adam"
    use_stateless_adam: Annotated[
        bool,
        Meta(
            description="Adam that keeps no moments: every step is Adam's first from zero exp_avg and "
            "exp_avg_sq (the same weights as --reset-optimizer-states before each step), so no optimizer "
            "state is held; needs --optimizer adam and, with --save, --no-save-optim (slime's)."
        ),
    ] = False
    weight_decay: Annotated[float, Meta(ge=0.0, description="Weight decay.")] = 0.01
    adam_beta1: Annotated[float, Meta(ge=0.0, lt=1.0, description="Adam beta1.")] = 0.9
    adam_beta2: Annotated[float, Meta(ge=0.0, lt=1.0, description="Adam beta2.")] = 0.999
    adam_eps: Annotated[float, Meta(gt=0.0, description="Adam epsilon.")] = 1e-8
    sgd_momentum: Annotated[float, Meta(ge=0.0, description="SGD momentum (--optimizer sgd).")] = 0.9
    clip_grad: Annotated[
        float, Meta(ge=0.0, description="Clip gradients to this global L2 norm (0: off).")
    ] = 1.0
    no_check_for_nan_in_loss_and_grad: Annotated[
        bool,
        Meta(
            description="Do not fail on a NaN/Inf gradient (Megatron's DDP check, on by default); as slime, "
            "a step whose gradient norm is not finite is skipped instead."
        ),
    ] = False
    optimizer_cpu_offload: Annotated[
        bool,
        Meta(
            description="Run the optimizer step on host RAM (Megatron's hybrid device optimizer; needs CUDA "
            "and --use-precision-aware-optimizer)."
        ),
    ] = False
    optimizer_offload_fraction: Annotated[
        float,
        Meta(ge=0.0, le=1.0, description="Share of the optimizer state --optimizer-cpu-offload moves."),
    ] = 1.0
    overlap_cpu_optimizer_d2h_h2d: Annotated[
        bool,
        Meta(description="Overlap the CPU optimizer step with its copies (with --optimizer-cpu-offload)."),
    ] = False
    use_precision_aware_optimizer: Annotated[
        bool,
        Meta(
            description="TransformerEngine's FusedAdam keeps the master weights and moments "
            "(needs TE, adam and --use-distributed-optimizer)."
        ),
    ] = False
    train_iters: Annotated[
        int | None,
        Meta(
            description="Optimizer steps of the whole run, the LR schedule's horizon "
            "(default: --num-rollout x steps per rollout)."
        ),
    ] = None
    lr_decay_style: Annotated[
        Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        Meta(description="Learning-rate decay schedule."),
    ] = "linear"
    lr_decay_iters: Annotated[
        int | None, Meta(description="Steps over which the LR decays (default: --train-iters).")
    ] = None
    min_lr: Annotated[float, Meta(ge=0.0, description="Lowest learning rate of the schedule.")] = 0.0
    lr_warmup_iters: Annotated[int, Meta(ge=0, description="Linear LR warm-up steps.")] = 0
    lr_warmup_fraction: Annotated[
        float | None, Meta(description="Warm-up as a fraction of --lr-decay-iters (instead of iters).")
    ] = None
    lr_warmup_init: Annotated[float, Meta(ge=0.0, description="Learning rate the warm-up starts from.")] = 0.0
    lr_wsd_decay_iters: Annotated[
        int | None, Meta(description="Annealing steps at the end of the WSD schedule.")
    ] = None
    lr_wsd_decay_style: Annotated[
        Literal["linear", "cosine", "exponential", "minus_sqrt"],
        Meta(description="Annealing shape of the WSD schedule."),
    ] = "exponential"
    bf16: Annotated[bool, Meta(description="Train in bfloat16 (mixed precision).")] = False
    fp16: Annotated[bool, Meta(description="Train in float16 (mixed precision, loss scaling).")] = False
    loss_scale: Annotated[
        float | None,
        Meta(description="Constant loss scale for --fp16/--bf16 (unset: dynamic scaling with --fp16)."),
    ] = None
    initial_loss_scale: Annotated[
        float, Meta(gt=0.0, description="First loss scale of --fp16 dynamic scaling.")
    ] = 2.0**32
    min_loss_scale: Annotated[float, Meta(gt=0.0, description="Floor of --fp16 dynamic loss scaling.")] = 1.0
    loss_scale_window: Annotated[
        float, Meta(gt=0.0, description="Steps without overflow before --fp16 dynamic scaling grows.")
    ] = 1000.0
    hysteresis: Annotated[
        int, Meta(ge=1, description="Overflows tolerated before --fp16 dynamic scaling shrinks.")
    ] = 2
    accumulate_allreduce_grads_in_fp32: Annotated[
        bool, Meta(description="Accumulate and all-reduce gradients in float32 (always on with --bf16).")
    ] = False
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
    calculate_per_token_loss: Annotated[
        bool,
        Meta(
            description="Megatron normalizes the loss by the step's trainable tokens (all micro-batches and "
            "data-parallel ranks) in its schedule, instead of tether's per-token weights."
        ),
    ] = False
    # Multi-token prediction (slime's MTP flags; tether.train.model.mtp).
    mtp_num_layers: Annotated[
        int | None,
        Meta(
            description="Build this many multi-token-prediction layers on the last pipeline stage, loaded "
            "from the checkpoint's MTP layers (num_nextn_predict_layers: MiMo, DeepSeek-V3, GLM-4.5); "
            "unset or 0: not built.",
        ),
    ] = None
    enable_mtp_training: Annotated[
        bool,
        Meta(
            description="Train the MTP layers: their loss (scaled by --mtp-loss-scaling-factor) joins each "
            "training step's loss; without it they are frozen and not run (needs --mtp-num-layers)."
        ),
    ] = False
    mtp_loss_scaling_factor: Annotated[
        float,
        Meta(description="Weight of the MTP loss (averaged over the MTP layers) in the training loss."),
    ] = 0.2
    # Mixture-of-experts knobs (Megatron's defaults; the experts' shape comes from the HF config).
    moe_router_load_balancing_type: Annotated[
        Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        Meta(description="MoE load-balancing loss (scaled by --moe-aux-loss-coeff)."),
    ] = "aux_loss"
    moe_aux_loss_coeff: Annotated[
        float, Meta(ge=0.0, description="Weight of the MoE load-balancing loss (0: off).")
    ] = 0.0
    moe_grouped_gemm: Annotated[
        bool, Meta(description="Run the local experts as one grouped GEMM (TransformerEngine, CUDA).")
    ] = False
    moe_token_dispatcher_type: Annotated[
        Literal["allgather", "alltoall", "flex"],
        Meta(description="How tokens reach their experts' ranks (flex needs DeepEP/HybridEP on GPUs)."),
    ] = "allgather"
    qwen_gdn_backend: Annotated[
        Literal["fla", "flashqla"],
        Meta(
            description="Kernel of the chunked gated delta rule in Qwen3-Next's and Qwen3.5's linear attention "
            "(slime's flag). fla: flash-linear-attention's where it is installed, else Megatron's pure-torch "
            "rule (the same recurrence; CPU ranks); flashqla: FlashQLA's (needs the flash_qla module and CUDA)."
        ),
    ] = "fla"
    moe_enable_deepep: Annotated[
        bool,
        Meta(
            description="DeepEP as the flex dispatcher's backend (needs --moe-token-dispatcher-type flex, CUDA "
            "and the deep_ep module)."
        ),
    ] = False
    moe_router_dtype: Annotated[
        Literal["fp32", "fp64"] | None,
        Meta(description="Precision of the router's scores and top-k (default: the model's dtype)."),
    ] = None
    moe_router_bias_update_rate: Annotated[
        float,
        Meta(
            ge=0.0,
            description="Step of the aux-loss-free expert-bias update (with --moe-router-enable-expert-bias).",
        ),
    ] = 1e-3
    moe_permute_fusion: Annotated[
        bool, Meta(description="Fused token permutation in the MoE dispatcher (TransformerEngine).")
    ] = False
    moe_token_drop_policy: Annotated[
        Literal["probs", "position"],
        Meta(description="Which tokens an expert over capacity drops (with an expert capacity factor)."),
    ] = "probs"

    # Model architecture (accepted so slime scripts parse; checked against the HF config where set).
    num_layers: Annotated[int | None, Meta(description="Transformer layers.")] = None
    hidden_size: Annotated[int | None, Meta(description="Hidden size.")] = None
    ffn_hidden_size: Annotated[int | None, Meta(description="MLP intermediate size.")] = None
    num_attention_heads: Annotated[int | None, Meta(description="Attention heads.")] = None
    num_query_groups: Annotated[
        int | None, Meta(description="Key/value heads (GQA groups; with --group-query-attention).")
    ] = None
    group_query_attention: Annotated[bool, Meta(description="Use grouped-query attention.")] = False
    kv_channels: Annotated[int | None, Meta(description="Attention head dimension.")] = None
    vocab_size: Annotated[int | None, Meta(description="Tokenizer vocabulary size.")] = None
    make_vocab_size_divisible_by: Annotated[
        int | None,
        Meta(description="Pad the embedding rows to a multiple of this times TP (default: of TP)."),
    ] = None
    max_position_embeddings: Annotated[
        int | None, Meta(description="Longest position the model supports.")
    ] = None
    seq_length: Annotated[
        int | None,
        Meta(description="Longest sample (prompt + response) the trainer accepts (default: the model's)."),
    ] = None
    rotary_base: Annotated[float | None, Meta(description="RoPE base (theta).")] = None
    rotary_percent: Annotated[
        float | None, Meta(description="Fraction of the head dim that RoPE rotates.")
    ] = None
    rotary_interleaved: Annotated[
        bool,
        Meta(description="RoPE rotates interleaved (adjacent) pairs of dims, not the two halves (GLM-4)."),
    ] = False
    norm_epsilon: Annotated[float | None, Meta(description="Epsilon of the normalization layers.")] = None
    normalization: Annotated[
        Literal["LayerNorm", "RMSNorm"] | None, Meta(description="Normalization layer.")
    ] = None
    swiglu: Annotated[bool, Meta(description="SwiGLU MLP.")] = False
    disable_bias_linear: Annotated[bool, Meta(description="No biases in linear layers.")] = False
    add_qkv_bias: Annotated[bool, Meta(description="Bias in the QKV projection (Qwen2).")] = False
    qk_layernorm: Annotated[bool, Meta(description="Normalize queries and keys per head (Qwen3).")] = False
    attention_output_gate: Annotated[
        bool,
        Meta(
            description="Full attention's output is gated per head by a sigmoid of a second query "
            "projection (Qwen3-Next's q_proj)."
        ),
    ] = False
    use_gated_attention: Annotated[
        bool,
        Meta(
            description="Gated full attention, as --attention-output-gate (slime's Qwen3-Next/Qwen3.5 scripts)."
        ),
    ] = False
    apply_layernorm_1p: Annotated[
        bool,
        Meta(description="Zero-centred RMSNorm weights: the norms scale by 1 + weight (Qwen3-Next)."),
    ] = False
    post_self_attn_layernorm: Annotated[
        bool,
        Meta(description="Normalize attention's output before the residual add (GLM-4's sandwich norm)."),
    ] = False
    post_mlp_layernorm: Annotated[
        bool, Meta(description="Normalize the MLP's output before the residual add (GLM-4's sandwich norm).")
    ] = False
    model_name: Annotated[
        str | None,
        Meta(
            description="slime's name of the model family its Megatron-to-HF conversion follows "
            "(minimax_m2, qwen3, deepseekv3, ...); tether converts by --hf-checkpoint's model_type, so a "
            "name of another family is refused."
        ),
    ] = None
    spec: Annotated[
        list[str] | None,
        Meta(
            description="Megatron-LM's layer-spec module and function. tether builds each family's layers "
            "itself; slime's GLM-4 spec (slime_plugins.models.glm4 get_glm_spec: the GPT layer with the "
            "--post-self-attn-layernorm/--post-mlp-layernorm norms) and MiniMax-M2 spec "
            "(slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec, for a minimax_m2 checkpoint: "
            "QK norms over all heads) and Qwen3-Next spec (slime_plugins.models.qwen3_next "
            "get_qwen3_next_spec, for a qwen3_next checkpoint: gated-DeltaNet linear attention) and Qwen3.5 "
            "spec (slime_plugins.models.qwen3_5 get_qwen3_5_spec, for a qwen3_5 or qwen3_5_moe checkpoint) are what "
            "it builds and are accepted; other specs are refused naming the module."
        ),
    ] = None
    untie_embeddings_and_output_weights: Annotated[
        bool, Meta(description="Separate input embedding and output layer weights.")
    ] = False
    use_rotary_position_embeddings: Annotated[bool, Meta(description="Rotary position embeddings.")] = False
    no_position_embedding: Annotated[
        bool,
        Meta(
            description="No learned absolute position embedding (Megatron-LM's deprecated spelling; accepted "
            "only with rotary position embeddings, as Megatron-LM)."
        ),
    ] = False
    position_embedding_type: Annotated[
        Literal["learned_absolute", "rope", "mrope", "relative", "none"] | None,
        Meta(description="Position embedding type."),
    ] = None
    attention_backend: Annotated[
        Literal["flash", "fused", "unfused", "local", "auto"] | None,
        Meta(description="Attention kernel: TransformerEngine's flash/fused/unfused, or Megatron's local."),
    ] = None
    use_flash_attn: Annotated[
        bool, Meta(description="FlashAttention (the same as --attention-backend flash; needs TE).")
    ] = False
    attention_softmax_in_fp32: Annotated[bool, Meta(description="Compute attention softmax in float32.")] = (
        False
    )
    no_rope_fusion: Annotated[bool, Meta(description="Disable the fused RoPE kernel (TE).")] = False
    no_masked_softmax_fusion: Annotated[
        bool, Meta(description="Disable the fused masked-softmax kernel.")
    ] = False
    no_gradient_accumulation_fusion: Annotated[
        bool, Meta(description="Disable fused gradient accumulation into the weight gradients.")
    ] = False
    # Mixture of experts / multi-latent attention shape (checked against the HF config where set).
    num_experts: Annotated[int | None, Meta(description="Routed experts per MoE layer.")] = None
    moe_router_topk: Annotated[int | None, Meta(description="Experts each token is routed to.")] = None
    moe_ffn_hidden_size: Annotated[int | None, Meta(description="Each routed expert's FFN size.")] = None
    moe_shared_expert_intermediate_size: Annotated[
        int | None, Meta(description="FFN size of the shared experts (all of them together).")
    ] = None
    moe_shared_expert_gate: Annotated[
        bool,
        Meta(
            description="The shared experts' output is gated per token by a sigmoid (Qwen2-MoE's, Qwen3-Next's "
            "and Qwen3.5's shared_expert_gate)."
        ),
    ] = False
    moe_layer_freq: Annotated[
        str | None,
        Meta(description="MoE layer pattern: N (every N-th layer) or a list such as [0]*1+[1]*2."),
    ] = None
    moe_router_score_function: Annotated[
        Literal["softmax", "sigmoid"] | None, Meta(description="Router score function.")
    ] = None
    moe_router_enable_expert_bias: Annotated[
        bool, Meta(description="Per-expert routing bias (aux-loss-free balancing; DeepSeek-V3's).")
    ] = False
    moe_router_pre_softmax: Annotated[
        bool,
        Meta(description="Score all experts before top-k, no renormalization (HF's norm_topk_prob=False)."),
    ] = False
    moe_router_topk_scaling_factor: Annotated[
        float | None, Meta(description="Scale of the routed experts' weights (routed_scaling_factor).")
    ] = None
    moe_router_num_groups: Annotated[
        int | None, Meta(description="Expert groups of group-limited routing (n_group).")
    ] = None
    moe_router_group_topk: Annotated[
        int | None, Meta(description="Groups each token may route into (topk_group).")
    ] = None
    multi_latent_attention: Annotated[bool, Meta(description="Multi-latent attention (DeepSeek).")] = False
    q_lora_rank: Annotated[int | None, Meta(description="MLA query low-rank dimension.")] = None
    kv_lora_rank: Annotated[int | None, Meta(description="MLA key/value low-rank dimension.")] = None
    qk_head_dim: Annotated[int | None, Meta(description="MLA query/key head dim without RoPE.")] = None
    qk_pos_emb_head_dim: Annotated[int | None, Meta(description="MLA query/key RoPE head dim.")] = None
    v_head_dim: Annotated[int | None, Meta(description="MLA value head dim.")] = None
    rotary_scaling_factor: Annotated[
        float | None, Meta(description="RoPE scaling factor (YaRN's, or Llama 3's).")
    ] = None
    mscale: Annotated[float | None, Meta(description="YaRN mscale of multi-latent attention.")] = None
    mscale_all_dim: Annotated[
        float | None, Meta(description="YaRN mscale_all_dim of multi-latent attention.")
    ] = None
    enable_experimental: Annotated[
        bool,
        Meta(
            description="Megatron's experimental features (megatron.core.config's flag, set on every trainer "
            "rank): e.g. the token dispatchers' fused permute that --moe-permute-fusion asks for."
        ),
    ] = False
    deterministic_mode: Annotated[
        bool,
        Meta(
            description="Deterministic kernels only: Megatron's deterministic mode, and torch's deterministic "
            "algorithms (cuDNN benchmarking off) on every trainer rank, so a rerun trains bit-identically."
        ),
    ] = False
    distributed_timeout_minutes: Annotated[
        int,
        Meta(
            ge=1,
            description="Timeout of the trainer ranks' process group (collectives), in minutes "
            "(slime's default).",
        ),
    ] = 10

    def __post_init__(self) -> None:
        _check_optional_ranges(self)
        self._check_parallelism()
        self._check_precision()
        self._check_optimizer()
        self._check_schedule()
        self._check_recompute()
        self._check_model_flags()

    def _check_parallelism(self) -> None:
        if self.moe_router_group_topk is not None and self.moe_router_num_groups is None:
            raise ConfigError(
                "--moe-router-group-topk", self.moe_router_group_topk, "needs --moe-router-num-groups"
            )
        for flag, value in (
            ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers),
        ):
            if value is not None and self.pipeline_model_parallel_size == 1:
                raise ConfigError(
                    flag, value, "sets a pipeline stage's layers; it needs --pipeline-model-parallel-size > 1"
                )
        if self.num_layers is not None:
            stage_layers(
                self.num_layers,
                self.pipeline_model_parallel_size,
                self.decoder_first_pipeline_num_layers,
                self.decoder_last_pipeline_num_layers,
                layers_flag="--num-layers",
            )
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ConfigError(
                "--overlap-param-gather",
                True,
                "needs --use-distributed-optimizer and --overlap-grad-reduce (as Megatron requires)",
            )

    def _check_precision(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--fp16", True, "contradicts --bf16; choose one precision")
        if self.loss_scale is not None and not (self.fp16 or self.bf16):
            raise ConfigError(
                "--loss-scale", self.loss_scale, "scales the loss of --fp16/--bf16 training; float32 has none"
            )
        dynamic = (
            ("--initial-loss-scale", self.initial_loss_scale, 2.0**32),
            ("--min-loss-scale", self.min_loss_scale, 1.0),
            ("--loss-scale-window", self.loss_scale_window, 1000.0),
            ("--hysteresis", self.hysteresis, 2),
        )
        for flag, value, default in dynamic:
            if value == default:
                continue
            if not self.fp16:
                raise ConfigError(flag, value, "tunes --fp16 dynamic loss scaling; it needs --fp16")
            if self.loss_scale is not None:
                raise ConfigError(
                    flag, value, f"tunes dynamic loss scaling, which --loss-scale={self.loss_scale} turns off"
                )

    def _check_optimizer(self) -> None:
        if self.optimizer == "sgd":
            for flag, value, default in (
                ("--adam-beta1", self.adam_beta1, 0.9),
                ("--adam-beta2", self.adam_beta2, 0.999),
                ("--adam-eps", self.adam_eps, 1e-8),
            ):
                if value != default:
                    raise ConfigError(flag, value, "applies to --optimizer adam, not sgd")
        elif self.sgd_momentum != 0.9:
            raise ConfigError("--sgd-momentum", self.sgd_momentum, "applies to --optimizer sgd, not adam")
        if self.use_precision_aware_optimizer:
            if self.optimizer != "adam":
                raise ConfigError(
                    "--use-precision-aware-optimizer",
                    True,
                    f"supports --optimizer adam only, not {self.optimizer}",
                )
        if self.use_stateless_adam and self.optimizer != "adam":
            raise ConfigError("--use-stateless-adam", True, f"is Adam; --optimizer is {self.optimizer}")
        if self.use_stateless_adam and self.use_precision_aware_optimizer:
            # TE's FusedAdam then keeps the master weights and moments itself (slime refuses it too).
            raise ConfigError(
                "--use-stateless-adam",
                True,
                "contradicts --use-precision-aware-optimizer, whose Adam keeps state",
            )
        if self.optimizer_cpu_offload and not self.use_precision_aware_optimizer:
            raise ConfigError(
                "--optimizer-cpu-offload",
                True,
                "needs --use-precision-aware-optimizer (Megatron's hybrid device optimizer shares its code path)",
            )
        if not self.optimizer_cpu_offload:
            if self.optimizer_offload_fraction != 1.0:
                raise ConfigError(
                    "--optimizer-offload-fraction",
                    self.optimizer_offload_fraction,
                    "applies with --optimizer-cpu-offload only",
                )
            if self.overlap_cpu_optimizer_d2h_h2d:
                raise ConfigError(
                    "--overlap-cpu-optimizer-d2h-h2d", True, "applies with --optimizer-cpu-offload only"
                )

    def _check_schedule(self) -> None:
        if self.lr_warmup_fraction is not None and self.lr_warmup_fraction >= 1.0:
            raise ConfigError(
                "--lr-warmup-fraction",
                self.lr_warmup_fraction,
                "must be below 1 (the warm-up ends before the decay)",
            )
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError(
                "--lr-warmup-fraction",
                self.lr_warmup_fraction,
                f"contradicts --lr-warmup-iters={self.lr_warmup_iters}; set one of them",
            )
        warms_up = self.lr_warmup_iters > 0 or bool(self.lr_warmup_fraction)
        if self.lr_warmup_init and not warms_up:
            raise ConfigError(
                "--lr-warmup-init",
                self.lr_warmup_init,
                "is where a warm-up starts; set --lr-warmup-iters or --lr-warmup-fraction",
            )
        if self.lr_decay_style == "constant":
            if self.min_lr:
                raise ConfigError("--min-lr", self.min_lr, "is never reached with --lr-decay-style constant")
            if self.lr_decay_iters is not None:
                raise ConfigError(
                    "--lr-decay-iters",
                    self.lr_decay_iters,
                    "has nothing to decay with --lr-decay-style constant",
                )
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_iters is None:
                raise ConfigError(
                    "--lr-decay-style", "WSD", "needs --lr-wsd-decay-iters (the annealing steps)"
                )
        else:
            if self.lr_wsd_decay_iters is not None:
                raise ConfigError(
                    "--lr-wsd-decay-iters", self.lr_wsd_decay_iters, "applies with --lr-decay-style WSD only"
                )
            if self.lr_wsd_decay_style != "exponential":
                raise ConfigError(
                    "--lr-wsd-decay-style", self.lr_wsd_decay_style, "applies with --lr-decay-style WSD only"
                )
        decay = self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters
        if decay is not None:
            if self.lr_warmup_iters >= decay and self.lr_decay_style != "constant":
                raise ConfigError(
                    "--lr-warmup-iters",
                    self.lr_warmup_iters,
                    f"must be below the decay horizon {decay} (--lr-decay-iters, default --train-iters)",
                )
            if self.lr_wsd_decay_iters is not None and self.lr_wsd_decay_iters > decay:
                raise ConfigError(
                    "--lr-wsd-decay-iters",
                    self.lr_wsd_decay_iters,
                    f"exceeds the decay horizon {decay} (--lr-decay-iters, default --train-iters)",
                )

    def _check_recompute(self) -> None:
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
        if self.recompute_num_layers is not None and self.recompute_granularity != "full":
            raise ConfigError(
                "--recompute-num-layers",
                self.recompute_num_layers,
                "applies only with --recompute-granularity full (selective recomputes parts of every layer)",
            )

    def _check_model_flags(self) -> None:
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ConfigError("--mtp-num-layers", self.mtp_num_layers, "must be >= 0")
        if self.mtp_loss_scaling_factor != 0.2 and not self.enable_mtp_training:
            raise ConfigError(
                "--mtp-loss-scaling-factor",
                self.mtp_loss_scaling_factor,
                "has no effect without --enable-mtp-training (no MTP loss is computed)",
            )
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise ConfigError(
                "--enable-mtp-training", True, "needs --mtp-num-layers (the MTP layers to train)"
            )
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ConfigError(
                "--num-query-groups",
                self.num_query_groups,
                "takes effect only with --group-query-attention (Megatron ignores it otherwise)",
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
        if (
            self.seq_length is not None
            and self.max_position_embeddings is not None
            and self.seq_length > self.max_position_embeddings
        ):
            raise ConfigError(
                "--seq-length",
                self.seq_length,
                f"exceeds --max-position-embeddings={self.max_position_embeddings}",
            )
        if self.use_flash_attn and self.attention_backend not in (None, "flash"):
            raise ConfigError(
                "--use-flash-attn", True, f"contradicts --attention-backend {self.attention_backend}"
            )
        if self.spec is not None:
            check_layer_spec(self.spec)
        if self.moe_enable_deepep and self.moe_token_dispatcher_type != "flex":
            raise ConfigError(
                "--moe-enable-deepep",
                True,
                f"needs --moe-token-dispatcher-type flex (DeepEP is a backend of Megatron's flex dispatcher), "
                f"not {self.moe_token_dispatcher_type}",
            )
        rope = self.position_embedding_type == "rope" or self.use_rotary_position_embeddings
        if self.no_position_embedding and not rope:
            # Megatron-LM raises the same at start-up: the flag is deprecated except beside rope.
            raise ConfigError(
                "--no-position-embedding",
                True,
                "is deprecated in Megatron-LM and accepted only with --position-embedding-type rope "
                "(every model family tether builds uses rotary embeddings)",
            )

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer state is sharded over DP: --use-distributed-optimizer, and also
        --use-precision-aware-optimizer, which Megatron runs only sharded (slime always shards)."""
        return self.use_distributed_optimizer or self.use_precision_aware_optimizer

    @property
    def resolved_attention_backend(self) -> str | None:
        """--attention-backend, with --use-flash-attn meaning flash (None: Megatron's default, auto)."""
        return "flash" if self.use_flash_attn else self.attention_backend

    @property
    def lr_decay_horizon(self) -> int | None:
        """Steps the LR decays over: --lr-decay-iters, else --train-iters (Megatron's default)."""
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

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
        # Megatron lays the experts out on their own grid: EP x ETP x PP must tile the ranks too.
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert_grid = self.expert_model_parallel_size * etp * self.pipeline_model_parallel_size
        if world_size % expert_grid:
            raise ConfigError(
                "--expert-model-parallel-size",
                self.expert_model_parallel_size,
                f"EP x ETP x PP = {expert_grid} must divide the {world_size} trainer ranks",
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
    if megatron.min_lr > algorithm.lr:
        raise ConfigError("--min-lr", megatron.min_lr, f"exceeds the peak --lr={algorithm.lr}")
    if megatron.lr_warmup_init > algorithm.lr:
        raise ConfigError(
            "--lr-warmup-init", megatron.lr_warmup_init, f"exceeds the peak --lr={algorithm.lr}"
        )
    if megatron.use_stateless_adam and algorithm.save is not None and not algorithm.no_save_optim:
        raise ConfigError(
            "--use-stateless-adam",
            True,
            "keeps no Adam moments for --save's checkpoints to hold: add --no-save-optim (as slime requires)",
        )
    if algorithm.custom_model_provider_path is not None and megatron.spec is not None:
        raise ConfigError(
            "--spec",
            megatron.spec,
            f"--custom-model-provider-path={algorithm.custom_model_provider_path!r} builds the model; "
            "a layer spec would not be used",
        )
    if megatron.calculate_per_token_loss and algorithm.per_rollout_loss_mean:
        raise ConfigError(
            "--calculate-per-token-loss",
            True,
            "contradicts --per-rollout-loss-mean; choose one loss reduction",
        )


def check_routing_replay(
    algorithm: AlgorithmConfig, megatron: MegatronConfig, hf_checkpoint: str | None
) -> None:
    """Refuse MoE routing replay (--use-routing-replay, --use-rollout-routing-replay) where there is
    no router to replay: a dense model (its HF config, when readable here, names no routed experts
    and --num-experts is unset), or a router without a top-k step (sinkhorn balancing)."""
    if not algorithm.use_routing_replay:  # R3 sets it too
        return
    flag = "--use-rollout-routing-replay" if algorithm.use_rollout_routing_replay else "--use-routing-replay"
    if getattr(megatron, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise ConfigError(
            "--moe-router-load-balancing-type", "sinkhorn", f"has no top-k routing for {flag} to replay"
        )
    if megatron.mtp_num_layers:
        # The engines report the decoder layers' experts only; an MoE MTP layer's router has no
        # recorded routing (and tether's replay would hook it as one more layer).
        raise ConfigError("--mtp-num-layers", megatron.mtp_num_layers, f"is not supported with {flag}")
    if getattr(megatron, "num_experts", None) or hf_checkpoint is None:
        return
    from pathlib import Path

    from tether.rollout.config import moe_routing

    if not (Path(hf_checkpoint) / "config.json").is_file():
        return  # not readable here (another node's path): the trainer refuses it at start
    if moe_routing(hf_checkpoint) is None:
        raise ConfigError(
            flag,
            True,
            f"replays Mixture-of-Experts routing, but {hf_checkpoint}/config.json is a dense model "
            "(no num_experts, n_routed_experts or num_local_experts) and --num-experts is unset",
        )


def check_checkpoint_flags(algorithm: AlgorithmConfig, *, auto_resume: bool) -> None:
    """Megatron's load flags need something they apply to: a checkpoint --load names (or --save
    with --auto-resume); --ckpt-step also applies to --ref-load (slime's rule)."""
    resumes = algorithm.load is not None or (auto_resume and algorithm.save is not None)
    for flag, value in (
        ("--no-load-optim", algorithm.no_load_optim),
        ("--no-load-rng", algorithm.no_load_rng),
        ("--finetune", algorithm.finetune),
    ):
        if value and not resumes:
            raise ConfigError(flag, True, "needs --load (or --save with --auto-resume): nothing is resumed")
    if algorithm.ckpt_step is not None and not resumes and algorithm.ref_load is None:
        raise ConfigError(
            "--ckpt-step", algorithm.ckpt_step, "needs --load, --ref-load, or --save with --auto-resume"
        )

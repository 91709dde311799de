"""Typed configuration slices of the rollout side: the prompt data (DataConfig) and generation (RolloutConfig).

Field names are slime's flag names (flag = `--` + name with `_` → `-`), with slime's defaults,
so a slime launch script parses unchanged. tether's own additions have self-explaining names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tether.rollout.http_proxy import check_proxy_url
from tether.rollout.rewards.types import BASE_TYPES, missing_requirement, split_rm_type
from tether.runtime.errors import ConfigError
from tether.runtime.rpc.secret import read_key_file

# Constrained scalars for optional fields: msgspec puts bounds on the number, not on `T | None`.
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
TopK = Annotated[int, Meta(ge=-1)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]

RoutingPolicy = Literal["round_robin", "least_in_flight", "consistent_hash"]
LossMaskType = Literal["qwen", "qwen3", "qwen3_5", "distill_qwen"]

AGENT_ENTRY = "tether.rollout.agents.generate"
"""The --custom-generate-function-path of tether's agent entry (tether.rollout.agents)."""

BUFFER_ROLLOUT = "tether.rollout.hooks.rollout_buffer.generate_rollout"
"""The --rollout-function-path that takes trajectories from slime's external rollout buffer."""


class DataConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Prompt data, batch sizes, epochs and evaluation data."""

    prompt_data: Annotated[
        str | None, Meta(description="Prompt file: JSONL (or parquet with pyarrow installed).")
    ] = None
    disable_rollout_global_dataset: Annotated[
        bool,
        Meta(
            description="No global prompt dataset (slime's rollout_global_dataset=False): the data source hands "
            "out blank numbered samples and is never saved or loaded; a custom --rollout-function-path (or "
            "--data-source-path class) supplies the prompts. Rejects --num-epoch and the default rollout."
        ),
    ] = False
    input_key: Annotated[str, Meta(description="Key of the prompt in each data record.")] = "input"
    label_key: Annotated[
        str | None, Meta(description="Key of the label (reference answer) in each record.")
    ] = None
    metadata_key: Annotated[str, Meta(description="Key of the per-record metadata dict.")] = "metadata"
    apply_chat_template: Annotated[
        bool, Meta(description="Render prompts (chat messages or text) with the tokenizer's chat template.")
    ] = False
    apply_chat_template_kwargs: Annotated[
        dict[str, Any],
        Meta(description="JSON object of extra keyword arguments for the tokenizer's apply_chat_template."),
    ] = msgspec.field(default_factory=dict)
    tool_key: Annotated[
        str | None,
        Meta(
            description="Key of the tools list (a list or its JSON text) in each record, passed to the chat "
            "template as `tools` and kept in the sample's metadata as `tools`."
        ),
    ] = "tools"
    loss_mask_type: Annotated[
        LossMaskType,
        Meta(
            description="Chat format whose assistant turns train in multi-turn samples (slime's "
            "MultiTurnLossMaskGenerator type; what hooks read as `args.loss_mask_type`)."
        ),
    ] = "qwen"
    start_rollout_id: Annotated[
        NonNegativeInt | None,
        Meta(
            description="Refused when set: tether starts at the rollout after the checkpoint it loads "
            "(1 after --finetune from a Megatron --load, as slime), else at 0."
        ),
    ] = None
    balance_data: Annotated[
        bool,
        Meta(
            description="Split each step's samples over the data-parallel ranks so their token counts "
            "balance (default: round-robin, sample i to rank i mod DP)."
        ),
    ] = False
    balance_by_flops: Annotated[
        bool,
        Meta(
            description="Form each step's micro-batches by estimated training FLOPs (coeff x L + L², from "
            "the model's shape) with Karmarkar-Karp instead of packing tokens, then deal them to the "
            "data-parallel ranks balancing FLOPs. A micro-batch may exceed --max-tokens-per-gpu (and "
            "run out of memory). Implies --balance-data; needs --use-dynamic-batch-size."
        ),
    ] = False
    rollout_shuffle: Annotated[bool, Meta(description="Shuffle the prompts each epoch.")] = False
    rollout_seed: Annotated[int, Meta(description="Seed for prompt shuffling and rollout randomness.")] = 42
    num_rollout: Annotated[
        PositiveInt | None, Meta(description="Number of rollout steps; derived from --num-epoch when unset.")
    ] = None
    num_epoch: Annotated[
        PositiveInt | None, Meta(description="Epochs over the prompts (used when --num-rollout is unset).")
    ] = None
    rollout_batch_size: Annotated[
        int,
        Meta(ge=1, description="Prompts (groups) per rollout step; samples = this x n-samples-per-prompt."),
    ] = 32
    n_samples_per_prompt: Annotated[int, Meta(ge=1, description="Responses generated for each prompt.")] = 1
    global_batch_size: Annotated[
        PositiveInt | None, Meta(description="Samples per optimizer step (default: one step per rollout).")
    ] = None
    num_steps_per_rollout: Annotated[
        PositiveInt | None, Meta(description="Optimizer steps per rollout (sets the global batch size).")
    ] = None
    micro_batch_size: Annotated[
        int, Meta(ge=1, description="Samples per micro-batch (without dynamic batching).")
    ] = 1
    use_dynamic_batch_size: Annotated[
        bool,
        Meta(description="Pack micro-batches up to --max-tokens-per-gpu tokens instead of a fixed size."),
    ] = False
    max_tokens_per_gpu: Annotated[
        PositiveInt | None, Meta(description="Token budget per micro-batch with --use-dynamic-batch-size.")
    ] = None
    eval_prompt_data: Annotated[
        list[str],
        Meta(description="Evaluation datasets as name/path pairs (`aime a.jsonl gsm b.jsonl`) or one path."),
    ] = msgspec.field(default_factory=list)
    eval_interval: Annotated[PositiveInt | None, Meta(description="Evaluate every this many rollouts.")] = (
        None
    )
    skip_eval_before_train: Annotated[bool, Meta(description="Do not evaluate before the first rollout.")] = (
        False
    )
    eval_input_key: Annotated[
        str | None, Meta(description="Prompt key for eval data (default --input-key).")
    ] = None
    eval_label_key: Annotated[
        str | None, Meta(description="Label key for eval data (default --label-key).")
    ] = None
    n_samples_per_eval_prompt: Annotated[int, Meta(ge=1, description="Responses per evaluation prompt.")] = 1
    eval_temperature: Annotated[
        NonNegativeFloat | None, Meta(description="Sampling temperature for evaluation (default: rollout's).")
    ] = None
    eval_top_p: Annotated[
        Probability | None, Meta(description="Top-p for evaluation (default: rollout's).")
    ] = None
    eval_top_k: Annotated[TopK | None, Meta(description="Top-k for evaluation (default: rollout's).")] = None
    eval_max_response_len: Annotated[
        PositiveInt | None, Meta(description="Max new tokens for evaluation (default: rollout's).")
    ] = None
    eval_max_prompt_len: Annotated[
        PositiveInt | None, Meta(description="Drop eval prompts longer than this (default: rollout's).")
    ] = None
    eval_max_context_len: Annotated[
        PositiveInt | None, Meta(description="Cap on eval prompt plus response tokens (default: rollout's).")
    ] = None
    eval_min_new_tokens: Annotated[
        NonNegativeInt | None, Meta(description="Min new tokens per eval response (SGLang's min_new_tokens).")
    ] = None
    eval_tool_key: Annotated[
        str | None, Meta(description="Tools key for eval data (default --tool-key).")
    ] = None
    eval_config: Annotated[
        str | None,
        Meta(
            description="slime's evaluation config (YAML/JSON): `eval.defaults` and `eval.datasets`, each "
            "dataset with its own keys, sampling, rm_type and metadata; when given, --eval-prompt-data is "
            "not read (slime's meaning)."
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.disable_rollout_global_dataset and self.num_epoch is not None and self.num_rollout is None:
            raise ConfigError(
                "--num-epoch",
                self.num_epoch,
                "counts epochs of the global dataset, which --disable-rollout-global-dataset turns off; "
                "set --num-rollout (slime's rule)",
            )
        if self.start_rollout_id is not None:
            raise ConfigError(
                "--start-rollout-id",
                self.start_rollout_id,
                "is not supported: tether starts at the rollout after the checkpoint it loads (--load, "
                "--auto-resume; 1 after --finetune from a Megatron --load, as slime) and at 0 otherwise, "
                "and has no way to start elsewhere",
            )
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ConfigError("--max-tokens-per-gpu", None, "must be set when --use-dynamic-batch-size is on")
        if self.balance_by_flops:
            if not self.use_dynamic_batch_size:
                raise ConfigError(
                    "--balance-by-flops",
                    True,
                    "needs --use-dynamic-batch-size (its micro-batch count comes from "
                    "--max-tokens-per-gpu; slime's rule)",
                )
            msgspec.structs.force_setattr(self, "balance_data", True)  # slime: the flag implies it
        if len(self.eval_prompt_data) > 1 and len(self.eval_prompt_data) % 2:
            raise ConfigError(
                "--eval-prompt-data", self.eval_prompt_data, "must be one path or name/path pairs"
            )
        if self.eval_top_k == 0:
            raise ConfigError("--eval-top-k", 0, "must be -1 (off) or at least 1")
        if self.eval_config is not None:
            from tether.rollout.data.eval_config import read_eval_config

            read_eval_config(self.eval_config)  # a bad file is refused now, naming the dataset and key
        total = self.rollout_batch_size * self.n_samples_per_prompt
        if self.num_steps_per_rollout is not None and total % self.num_steps_per_rollout:
            raise ConfigError(
                "--num-steps-per-rollout",
                self.num_steps_per_rollout,
                f"must divide rollout-batch-size x n-samples-per-prompt = {total}",
            )
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            if self.global_batch_size * self.num_steps_per_rollout != total:
                raise ConfigError(
                    "--global-batch-size",
                    self.global_batch_size,
                    f"contradicts --num-steps-per-rollout={self.num_steps_per_rollout} "
                    f"(their product must be {total})",
                )

    def eval_datasets(self) -> list[tuple[str, str]]:
        """(name, path) pairs from --eval-config, else --eval-prompt-data (a single path is named
        after its file)."""
        if self.eval_config is not None:
            from tether.rollout.data.eval_config import read_eval_config

            return [(str(e["name"]), str(e["path"])) for e in read_eval_config(self.eval_config)[1]]
        items = self.eval_prompt_data
        if len(items) == 1:
            path = items[0]
            stem = path.rsplit("/", 1)[-1].split(".", 1)[0] or "eval"
            return [(stem, path)]
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]

    def train_step_of(self, rollout_id: int) -> int:
        """Optimizer steps taken before rollout `rollout_id` (slime's step with
        --wandb-always-use-train-step)."""
        return (
            rollout_id
            * self.rollout_batch_size
            * self.n_samples_per_prompt
            // self.resolved_global_batch_size
        )

    @property
    def resolved_global_batch_size(self) -> int:
        """Samples per optimizer step after --num-steps-per-rollout is taken into account."""
        total = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None:
            return self.global_batch_size
        return total // (self.num_steps_per_rollout or 1)


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How rollouts are generated: engine, sampling, rewards, hooks, dynamic sampling, fully-async."""

    hf_checkpoint: Annotated[
        str | None, Meta(description="Hugging Face model directory: engines' weights and the tokenizer.")
    ] = None
    rollout_engine: Annotated[
        Literal["sglang", "cpu"], Meta(description="Generation backend: real SGLang or tether's CPU engine.")
    ] = "sglang"
    rollout_function_path: Annotated[
        str,
        Meta(description="Rollout function `generate_rollout(args, rollout_id, data_source, evaluation)`."),
    ] = "tether.rollout.hooks.default_rollout.generate_rollout"
    rollout_temperature: Annotated[float, Meta(ge=0, description="Sampling temperature during rollout.")] = (
        1.0
    )
    rollout_top_p: Annotated[float, Meta(gt=0, le=1, description="Top-p during rollout.")] = 1.0
    rollout_top_k: Annotated[int, Meta(ge=-1, description="Top-k during rollout (-1: off).")] = -1
    rollout_max_response_len: Annotated[
        PositiveInt | None, Meta(description="Max new tokens per response (SGLang's max_new_tokens).")
    ] = None
    rollout_max_prompt_len: Annotated[
        PositiveInt | None, Meta(description="Drop prompts longer than this many tokens (counted).")
    ] = None
    rollout_max_context_len: Annotated[
        PositiveInt | None, Meta(description="Cap on prompt plus response tokens during rollout.")
    ] = None
    rollout_stop: Annotated[list[str], Meta(description="Stop strings for generation.")] = msgspec.field(
        default_factory=list
    )
    rollout_stop_token_ids: Annotated[list[int], Meta(description="Stop token ids for generation.")] = (
        msgspec.field(default_factory=list)
    )
    rollout_skip_special_tokens: Annotated[
        bool, Meta(description="Skip special tokens in the response text.")
    ] = False
    over_sampling_batch_size: Annotated[
        PositiveInt | None,
        Meta(description="Groups drawn per sampling round (default --rollout-batch-size)."),
    ] = None
    dynamic_sampling_filter_path: Annotated[
        str | None,
        Meta(
            description="Group filter `filter(args, samples)`; built in: tether.rollout.rewards.scoring.check_reward_nonzero_std."
        ),
    ] = None
    data_source_path: Annotated[
        str | None,
        Meta(
            description="slime's data source class, built as cls(args): get_samples(n) groups, add_samples, "
            "save(rollout_id) at each checkpoint, load(start_rollout_id - 1) before the first rollout, len "
            "(default, or slime.rollout.data_source.RolloutDataSourceWithBuffer: tether's own, from "
            "--prompt-data)."
        ),
    ] = None
    buffer_filter_path: Annotated[
        str | None,
        Meta(
            description="Which buffered groups (partial or requeued) a rollout takes first: "
            "`filter(args, rollout_id, buffer, num_samples)` returns up to num_samples groups and removes "
            "them from buffer (slime's meaning; default: the oldest first)."
        ),
    ] = None
    partial_rollout: Annotated[
        bool, Meta(description="Keep unfinished (aborted) samples and continue them in the next rollout.")
    ] = False
    mask_offpolicy_in_partial_rollout: Annotated[
        bool, Meta(description="In partial rollout, train only on tokens generated by the latest weights.")
    ] = False
    custom_generate_function_path: Annotated[
        str | None,
        Meta(description="Replace per-sample generation: `async generate(args, sample, sampling_params)`."),
    ] = None
    custom_rm_path: Annotated[
        str | None,
        Meta(description="Reward function `async reward(args, sample)` (or over a group with --group-rm)."),
    ] = None
    rm_type: Annotated[
        str | None,
        Meta(
            description="Built-in reward (slime's rm_hub): math, deepscaler, dapo, f1, gpqa, ifbench, random, "
            "remote_rm, exact_match, or boxed_<type> (scores the last \\boxed{} of the response); a sample's "
            "metadata `rm_type` overrides it."
        ),
    ] = None
    rm_url: Annotated[str | None, Meta(description="Reward-model service URL for --rm-type remote_rm.")] = (
        None
    )
    http_proxy: Annotated[
        str | None,
        Meta(
            description="Proxy for calls to hosts outside this machine: --rm-url's reward model, the "
            "rollout buffer, hooks' slime `post` (loopback - engines, router - is always reached directly)."
        ),
    ] = None
    group_rm: Annotated[bool, Meta(description="Compute rewards over a whole group at once.")] = False
    reward_key: Annotated[str | None, Meta(description="Key selecting the reward from a dict reward.")] = None
    log_passrate: Annotated[
        bool,
        Meta(
            description="Log pass@k of each rollout (k = 1, 2, 4, ... up to the group size; unbiased "
            "estimator over each prompt's samples, a sample passing when its reward is 1)."
        ),
    ] = False
    log_correct_samples: Annotated[
        bool,
        Meta(
            description="Log, each step, the samples with raw reward 1: the fraction of them per quarter of "
            "--rollout-max-response-len (rollout/correct_length/p25 ... p100) and their mean negative "
            "log-prob under the trainer (rollout/correct_entropy, when the step computes log-probs) "
            "(slime's meaning)."
        ),
    ] = False
    rollout_sample_hook_path: Annotated[
        list[str],
        Meta(
            description="Given once per hook, applied in order to each generated sample before its reward: "
            "`hook(args, sample, *, rollout_id=None, evaluation=False)` (sync or async) returns a Sample "
            "or None (keep the one it got), as slime calls it.",
            extra={"repeat": True},
        ),
    ] = msgspec.field(default_factory=list)
    rollout_sample_filter_path: Annotated[
        str | None,
        Meta(
            description="After each rollout `fn(args, samples)` over the kept groups (slime's Samples): a sample "
            "it marks `remove_sample = True` trains nothing (its loss mask is zeroed) but still counts in "
            "its group's advantage normalisation, as in slime. Returns None."
        ),
    ] = None
    rollout_all_samples_process_path: Annotated[
        str | None,
        Meta(
            description="After each rollout `fn(args, all_samples, data_source)` over every group that finished, "
            "the ones the dynamic filter dropped and the surplus too (slime's Samples, read-only)."
        ),
    ] = None
    custom_rollout_log_function_path: Annotated[
        str | None,
        Meta(
            description="Each step `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time)`; when it "
            "returns True tether's own rollout/* and perf/* figures of that step are not logged (slime's meaning)."
        ),
    ] = None
    custom_eval_rollout_log_function_path: Annotated[
        str | None,
        Meta(
            description="Each evaluation `fn(rollout_id, args, data, extra_metrics)`, data = {dataset: {rewards, "
            "truncated, samples}}; when it returns True tether's own eval/* figures are not logged."
        ),
    ] = None
    eval_reward_key: Annotated[
        str | None, Meta(description="--reward-key for evaluation (default: --reward-key).")
    ] = None
    eval_function_path: Annotated[
        str | None,
        Meta(
            description="The evaluation function `fn(args, rollout_id, data_source, evaluation=True)` "
            "(slime's meaning; default: the rollout function's evaluation)."
        ),
    ] = None
    log_multi_turn: Annotated[
        bool,
        Meta(
            description="Log multi-turn figures each step: response lengths with and without observation "
            "tokens (loss mask), their clip ratio, and samples' metadata `round_number` (slime's meaning)."
        ),
    ] = False
    log_reward_category: Annotated[
        str | None,
        Meta(
            description="With dict rewards: log the fraction of each rollout's samples per value of this reward "
            "key, as `error_cat/<value>` (slime's meaning)."
        ),
    ] = None
    sglang_server_concurrency: Annotated[
        int, Meta(ge=1, description="Concurrent generate requests per engine.")
    ] = 512
    use_sglang_router: Annotated[
        bool, Meta(description="Route through an sglang-router process instead of tether's built-in router.")
    ] = False
    rollout_routing_policy: Annotated[
        RoutingPolicy,
        Meta(description="Built-in router policy; consistent_hash keeps a session on one engine."),
    ] = "least_in_flight"
    engine_request_timeout_seconds: Annotated[
        float, Meta(gt=0, description="Timeout for one HTTP request to an engine.")
    ] = 600.0
    engine_api_key_file: Annotated[
        str | None,
        Meta(
            description="File holding the API key engines require as 'Authorization: Bearer <key>' (one "
            "line, at least 16 visible ASCII characters, the file chmod 600). Needed to reach external "
            "engines started with --api-key; tether's own engines, the sglang-router and the trainer "
            "ranks then use it too. Default: a fresh random key per run, given to the engines tether "
            "starts in their environment, never on a command line."
        ),
    ] = None
    engine_allow_nonfinite_weights: Annotated[
        bool,
        Meta(
            description="CPU engine: accept weight updates holding NaN or inf (refused by default with 400 "
            "naming the tensor). Real SGLang makes no such check."
        ),
    ] = False
    max_weight_staleness: Annotated[
        NonNegativeInt | None,
        Meta(description="Fully-async: drop groups whose oldest weight version lags more."),
    ] = None
    fully_async_max_groups_in_flight: Annotated[
        PositiveInt | None,
        Meta(description="Fully-async: groups generating at once (default --rollout-batch-size)."),
    ] = None
    fully_async_requeue_stale_groups: Annotated[
        bool, Meta(description="Fully-async: regenerate stale groups' prompts instead of dropping them.")
    ] = False
    rollout_buffer_url: Annotated[
        str | None,
        Meta(
            description=f"URL of slime's external rollout buffer (slime_plugins/rollout_buffer/buffer.py): "
            f"--rollout-function-path {BUFFER_ROLLOUT} starts it and takes each rollout's trajectories "
            "from it (`args.rollout_buffer_url` for a rollout function of your own)."
        ),
    ] = None
    fetch_trajectory_retry_times: Annotated[
        int,
        Meta(
            ge=-1,
            description="Failed requests to the rollout buffer one rollout tolerates before it gives up "
            "(-1: retry without limit).",
        ),
    ] = -1
    min_batch_collection_ratio: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="Fraction of --rollout-batch-size groups the rollout buffer must have delivered "
            "before a rollout trains on a short batch when the buffer has nothing more at hand "
            "(1: always the whole batch).",
        ),
    ] = 1.0
    rollout_task_type: Annotated[
        str,
        Meta(
            description="Task type the rollout buffer generates trajectories for (its generator's TASK_TYPE), "
            "sent when the buffer is started."
        ),
    ] = "math"
    agent_function_path: Annotated[
        str | None,
        Meta(
            description=f"Agent entry (--custom-generate-function-path {AGENT_ENTRY}): the agent, "
            "`async agent(run)` given a tether.rollout.agents.AgentRun (adapter URL, session key, prompt); "
            "what it returns is its output, scored as the response."
        ),
    ] = None
    agent_command: Annotated[
        str | None,
        Meta(
            description="Agent entry: the agent as a shell command, run per sample with OPENAI_BASE_URL / "
            "ANTHROPIC_BASE_URL, the session key as OPENAI_API_KEY / ANTHROPIC_API_KEY and the prompt on "
            "stdin; its stdout is its output."
        ),
    ] = None
    agent_api: Annotated[
        Literal["openai", "anthropic"] | None,
        Meta(
            description="Agent entry: the API the agent speaks, OpenAI Chat Completions or Anthropic Messages (default openai)."
        ),
    ] = None
    agent_time_budget_sec: Annotated[
        PositiveInt | None,
        Meta(
            description="Agent entry: seconds an agent run may take before it is stopped and its sample fails (default 1800)."
        ),
    ] = None
    agent_max_turns: Annotated[
        PositiveInt | None,
        Meta(
            description="Agent entry: model turns one agent run may take; the next is refused with 429 (default: no cap)."
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.rollout_top_k == 0:
            raise ConfigError("--rollout-top-k", 0, "must be -1 (off) or at least 1")
        if self.engine_api_key_file is not None:
            read_key_file(self.engine_api_key_file, "--engine-api-key-file")  # refused now, not at start
        if self.rm_type is not None:
            check_rm_type("--rm-type", self.rm_type)
        if self.rm_type == "remote_rm" and not self.rm_url:
            raise ConfigError("--rm-url", self.rm_url, "must be set for --rm-type remote_rm")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ConfigError(
                "--mask-offpolicy-in-partial-rollout", True, "only applies with --partial-rollout"
            )
        if self.http_proxy is not None:
            check_proxy_url(self.http_proxy)
        if self.rm_url is not None and not self.rm_url.startswith(("http://", "https://")):
            raise ConfigError("--rm-url", self.rm_url, "must be an http:// or https:// URL")
        for path_flag, value in (
            ("--rollout-function-path", self.rollout_function_path),
            ("--custom-generate-function-path", self.custom_generate_function_path),
            ("--custom-rm-path", self.custom_rm_path),
            ("--dynamic-sampling-filter-path", self.dynamic_sampling_filter_path),
            ("--buffer-filter-path", self.buffer_filter_path),
            ("--data-source-path", self.data_source_path),
            ("--rollout-sample-filter-path", self.rollout_sample_filter_path),
            ("--rollout-all-samples-process-path", self.rollout_all_samples_process_path),
            ("--custom-rollout-log-function-path", self.custom_rollout_log_function_path),
            ("--custom-eval-rollout-log-function-path", self.custom_eval_rollout_log_function_path),
            ("--eval-function-path", self.eval_function_path),
            *(("--rollout-sample-hook-path", p) for p in self.rollout_sample_hook_path),
        ):
            if value is not None and "." not in value and ":" not in value:
                raise ConfigError(path_flag, value, "must be `package.module.function` or `file.py:function`")
        self._check_agent_flags()
        self._check_rollout_buffer_flags()
        if self.log_correct_samples and self.rollout_max_response_len is None:
            raise ConfigError(
                "--log-correct-samples",
                True,
                "bins correct responses by quarters of --rollout-max-response-len, which must be set",
            )
        if self.rollout_max_context_len is not None and self.rollout_max_response_len is not None:
            if self.rollout_max_response_len >= self.rollout_max_context_len:
                raise ConfigError(
                    "--rollout-max-response-len",
                    self.rollout_max_response_len,
                    f"leaves no room for a prompt within --rollout-max-context-len={self.rollout_max_context_len}",
                )

    def _check_rollout_buffer_flags(self) -> None:
        """slime's rollout-buffer flags act through a rollout function that reads them: tether's
        BUFFER_ROLLOUT (which needs the URL), or one of the user's (as `args.<name>`); the default
        rollout reads none of them, so there they are refused rather than ignored."""
        if self.fetch_trajectory_retry_times == 0:
            raise ConfigError(
                "--fetch-trajectory-retry-times", 0, "must be -1 (retry without limit) or at least 1"
            )
        url = self.rollout_buffer_url
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError("--rollout-buffer-url", url, "must be an http:// or https:// URL")
        if self.rollout_function_path == BUFFER_ROLLOUT:
            if url is None:
                raise ConfigError(
                    "--rollout-buffer-url", None, f"must be set for --rollout-function-path {BUFFER_ROLLOUT}"
                )
            if self.hf_checkpoint is None:
                raise ConfigError(
                    "--hf-checkpoint",
                    None,
                    f"must be set for --rollout-function-path {BUFFER_ROLLOUT}: its tokenizer turns the "
                    "buffer's chat messages into tokens",
                )
        defaults = {f.name: f.default for f in msgspec.structs.fields(self)}
        if self.rollout_function_path != defaults["rollout_function_path"]:
            return
        for name in (
            "rollout_buffer_url",
            "fetch_trajectory_retry_times",
            "min_batch_collection_ratio",
            "rollout_task_type",
        ):
            if getattr(self, name) != defaults[name]:
                raise ConfigError(
                    "--" + name.replace("_", "-"),
                    getattr(self, name),
                    "is read by a rollout function that talks to slime's rollout buffer, and the default "
                    f"rollout does not: use --rollout-function-path {BUFFER_ROLLOUT}, or one of your own "
                    f"that reads args.{name}",
                )

    def _check_agent_flags(self) -> None:
        """The agent flags apply to the agent entry only, which runs exactly one agent."""
        flags = {
            "--agent-function-path": self.agent_function_path,
            "--agent-command": self.agent_command,
            "--agent-api": self.agent_api,
            "--agent-time-budget-sec": self.agent_time_budget_sec,
            "--agent-max-turns": self.agent_max_turns,
        }
        if self.custom_generate_function_path != AGENT_ENTRY:
            for flag, value in flags.items():
                if value is not None:
                    raise ConfigError(
                        flag, value, f"only applies with --custom-generate-function-path {AGENT_ENTRY}"
                    )
            return
        if (self.agent_function_path is None) == (self.agent_command is None):
            raise ConfigError(
                "--agent-function-path",
                self.agent_function_path,
                f"{AGENT_ENTRY} runs one agent: set exactly one of --agent-function-path and --agent-command"
                + (f" (--agent-command is {self.agent_command!r})" if self.agent_command else ""),
            )
        if self.group_rm:
            raise ConfigError(
                "--group-rm", True, f"{AGENT_ENTRY} scores each agent run by itself; drop --group-rm"
            )


def check_buffer_rollout(
    rollout: RolloutConfig, *, loop: str, use_rollout_logprobs: bool, use_tis: bool
) -> None:
    """BUFFER_ROLLOUT against the other slices: it is a rollout function (the fully-async loop
    calls none), and the buffer's trajectories are chat messages, with no engine log-probs."""
    if rollout.rollout_function_path != BUFFER_ROLLOUT:
        return
    if loop == "fully-async":
        raise ConfigError(
            "--loop",
            loop,
            f"generates with tether's fully-async worker and calls no --rollout-function-path, so "
            f"{BUFFER_ROLLOUT} would never run; use --loop sync or async",
        )
    for flag, value in (("--use-rollout-logprobs", use_rollout_logprobs), ("--use-tis", use_tis)):
        if value:
            raise ConfigError(
                flag,
                True,
                f"needs the engine's log-probs, and the trajectories {BUFFER_ROLLOUT} takes from the "
                "rollout buffer carry none (slime's buffer sends chat messages)",
            )


def check_rm_type(flag: str, rm_type: str) -> None:
    """Refuse a reward type tether does not know, or one whose scorer needs a missing package."""
    base, _ = split_rm_type(rm_type)
    if base not in BASE_TYPES:
        raise ConfigError(
            flag, rm_type, f"is not a reward type; known: {', '.join(BASE_TYPES)} (each also as boxed_<type>)"
        )
    missing = missing_requirement(rm_type)
    if missing is not None:
        raise ConfigError(flag, rm_type, missing)


class MoeRouting(msgspec.Struct, frozen=True):
    """What an MoE model's routed experts look like: every layer of the model (dense ones too, as
    SGLang reports them), `topk` experts per token out of `experts`."""

    layers: int
    topk: int
    experts: int


_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
"""Where the families' HF configs hold the routed expert count (Qwen-MoE; DeepSeek/GLM-MoE; Mixtral)."""


def moe_routing(hf_dir: str) -> MoeRouting | None:
    """The routing shape of the HF model in `hf_dir` (its config.json), or None for a dense model."""
    import json
    from pathlib import Path

    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--hf-checkpoint", hf_dir, f"cannot read {path}: {exc}") from exc
    experts = next((cfg[k] for k in _EXPERT_COUNT_KEYS if cfg.get(k)), None)
    if not experts:
        return None
    for key in ("num_hidden_layers", "num_experts_per_tok"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ConfigError(f"{path}:{key}", cfg.get(key), "must be a positive int in an MoE config")
    return MoeRouting(layers=cfg["num_hidden_layers"], topk=cfg["num_experts_per_tok"], experts=int(experts))

"""slime's flag names on the `args` hooks receive, where tether's configuration says it differently.

Hooks read `args` as slime's flat argparse namespace. tether's `FlatArgs` already answers every
flag both share (`args.rollout_temperature`, `args.n_samples_per_prompt`, ...); `slime_args` adds
the rest: the keys of --custom-config-path's YAML that name no flag, the --sglang-* flags passed
through to the engines (as `sglang_<flag>`), the address of the HTTP
endpoint that routes to tether's engines
(`sglang_router_ip` / `sglang_router_port`, tether's router front), values slime resolves at
start that tether leaves unset (`over_sampling_batch_size`, `global_batch_size`), and slime's
switches for features tether does not have, set to off, so that a hook branching on them takes
the path tether runs.
"""

from __future__ import annotations

from typing import Any

from tether.runtime.custom_config import hook_extras

ROUTER_POLICY = {
    "round_robin": "round_robin",
    "least_in_flight": "power_of_two",
    "consistent_hash": "consistent_hashing",
}
"""tether's --rollout-routing-policy as sglang-router's policy name (slime's `args.router_policy`)."""

FEATURES_OFF: dict[str, Any] = {
    "rollout_global_dataset": True,  # slime_args sets it from --disable-rollout-global-dataset
    "ci_test": False,
    "use_rollout_routing_replay": False,
    "use_routing_replay": False,
    "use_distributed_post": False,
    "use_opd": False,
    "use_rollout_entropy": False,
    "sglang_enable_deterministic_inference": False,
    "sglang_speculative_algorithm": None,
    "sglang_dp_size": None,
    "sglang_model_routers": None,
    "multimodal_keys": None,
    "eval_tool_key": None,
    "eval_reward_key": None,
    "eval_max_prompt_len": None,
    "eval_max_context_len": None,
    "eval_min_new_tokens": None,
    "eval_config": None,
    "rollout_sample_filter_path": None,
    "rollout_all_samples_process_path": None,
    "rollout_sample_hook_path": None,
    "rollout_data_postprocess_path": None,
    "custom_reward_post_process_path": None,
    "custom_convert_samples_to_train_data_path": None,
    "custom_rollout_log_function_path": None,
    "custom_eval_rollout_log_function_path": None,
    "data_source_path": None,
    "dump_details": None,
}
"""slime flags for features tether does not run, at the value that means "off"."""


def slime_args(config: Any, *, router_ip: str | None, router_port: int | None) -> dict[str, Any]:
    """What `args` answers for a slime hook beyond tether's own fields (see the module docstring)."""
    rollout, data = config.rollout, config.data
    # A feature tether has grown answers with its own flag's value, not with "off".
    slices = [getattr(config, name) for name in getattr(config, "__struct_fields__", ())]
    own = {field for part in slices for field in getattr(part, "__struct_fields__", ())}
    extra: dict[str, Any] = {k: v for k, v in FEATURES_OFF.items() if k not in own}
    # slime's dest of --disable-rollout-global-dataset
    extra["rollout_global_dataset"] = not getattr(data, "disable_rollout_global_dataset", False)
    extra["sglang_router_ip"] = router_ip
    extra["sglang_router_port"] = router_port
    extra["router_policy"] = ROUTER_POLICY.get(rollout.rollout_routing_policy, rollout.rollout_routing_policy)
    extra["over_sampling_batch_size"] = rollout.over_sampling_batch_size or data.rollout_batch_size
    resolved = getattr(data, "resolved_global_batch_size", None)
    if resolved is not None:
        extra["global_batch_size"] = resolved
    extra["eval_function_path"] = rollout.rollout_function_path
    algorithm = getattr(config, "algorithm", None)
    if algorithm is not None:
        extra["opsm_delta"] = algorithm.opsm_threshold  # slime resolves its default into args
    extra.update(sglang_flag_values(getattr(config, "sglang_args", None) or []))
    extra.update(custom_config_extras(config))
    return extra


def custom_config_extras(config: Any) -> dict[str, Any]:
    """--custom-config-path's keys that name no flag: attributes of every hook's args (slime sets
    them all; those naming a flag were applied to the configuration when it was parsed)."""
    slices = [getattr(config, name) for name in getattr(config, "__struct_fields__", ())]
    own = {field for part in slices for field in getattr(part, "__struct_fields__", ())}
    algorithm = getattr(config, "algorithm", None)
    return hook_extras(getattr(algorithm, "custom_config_path", None), own)


def sglang_flag_values(sglang_args: list[str]) -> dict[str, Any]:
    """The --sglang-* flags passed through to the engines under slime's names for them
    (`--sglang-tool-call-parser qwen25` is `args.sglang_tool_call_parser == "qwen25"`): one value
    as its number or string, several as a list, none as True."""
    out: dict[str, Any] = {}
    name: str | None = None
    values: list[str] = []

    def close() -> None:
        if name is not None:
            typed = [_scalar(v) for v in values]
            out["sglang_" + name] = True if not typed else typed[0] if len(typed) == 1 else typed

    for item in sglang_args:
        if item.startswith("--"):
            close()
            flag, eq, value = item[2:].partition("=")
            name, values = flag.replace("-", "_"), [value] if eq else []
        else:
            values.append(item)
    close()
    return out


def _scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text

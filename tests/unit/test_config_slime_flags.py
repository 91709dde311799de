"""slime's flags tether does not implement are refused by name with the reason, never accepted."""

from __future__ import annotations

import pytest

from tether.checks.slime_flags import MEGATRON_NOT_IMPLEMENTED, NOT_IMPLEMENTED
from tether.config import flag_specs, resolve
from tether.runtime.errors import ConfigError


def test_no_refused_flag_is_also_a_tether_flag() -> None:
    ours = {s.flag for s in flag_specs()}
    assert sorted((set(NOT_IMPLEMENTED) | set(MEGATRON_NOT_IMPLEMENTED)) & ours) == []
    assert all(flag.startswith("--") and reason for flag, reason in NOT_IMPLEMENTED.items())


@pytest.mark.parametrize(
    ("argv", "key", "value", "reason"),
    [
        (["--use-distributed-post"], "--use-distributed-post", True, "needs Ray"),
        (["--train-backend", "fsdp"], "--train-backend", "fsdp", "Megatron only"),
        (["--use-distributed-post"], "--use-distributed-post", True, "needs Ray"),
        (["--rollout-data-transport", "nixl"], "--rollout-data-transport", "nixl", "ZeroMQ"),
    ],
)
def test_a_slime_flag_tether_lacks_is_refused_with_its_reason(
    argv: list[str], key: str, value: object, reason: str
) -> None:
    with pytest.raises(ConfigError, match=f"flag, not supported by tether: .*{reason}") as err:
        resolve(argv)
    assert (err.value.key, err.value.value) == (key, value)


def test_an_unknown_flag_is_still_named() -> None:
    with pytest.raises(ConfigError, match="is not a tether, slime or Megatron flag"):
        resolve(["--no-such-flag-anywhere"])


def test_slimes_fully_async_rollout_function_selects_the_fully_async_loop() -> None:
    from tether.config import SLIME_FULLY_ASYNC

    cfg = resolve(["--rollout-function-path", SLIME_FULLY_ASYNC])
    assert cfg.run.loop == "fully-async"
    assert cfg.rollout.rollout_function_path == "tether.rollout.hooks.default_rollout.generate_rollout"
    with pytest.raises(ConfigError, match="contradicts --rollout-function-path"):
        resolve(["--rollout-function-path", SLIME_FULLY_ASYNC, "--loop", "sync"])


def test_slimes_glm4_layer_spec_is_accepted_and_other_plugin_specs_are_refused_by_module() -> None:
    # slime's GLM-4 spec is the GPT layer with the post-sublayer norms tether builds from the flags.
    cfg = resolve(["--spec", "slime_plugins.models.glm4", "get_glm_spec"])
    assert cfg.megatron.spec == ["slime_plugins.models.glm4", "get_glm_spec"]
    cfg = resolve(["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec"])  # Qwen3.5's layers
    assert cfg.megatron.spec == ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    cfg = resolve(["--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec"])  # sparse attention
    assert cfg.megatron.spec == ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]
    with pytest.raises(ConfigError, match=r"'slime_plugins\.models\.glm5\.other'.*builds the layers") as err:
        resolve(["--spec", "slime_plugins.models.glm5.other", "get_glm5_spec"])
    assert err.value.key == "--spec"
    with pytest.raises(ConfigError, match="module and a function"):
        resolve(["--spec", "slime_plugins.models.glm4"])

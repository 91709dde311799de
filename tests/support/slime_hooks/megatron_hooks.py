"""slime-style Megatron hooks for tests: each records its call in CALLS (the model provider builds
tether's own GPTModel from the `config` it is given and the shape in PROVIDER_SHAPE)."""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
PROVIDER_SHAPE: dict[str, Any] = {}
"""What the provider needs beyond `config`: the ModelArch and Topology of the chunk it builds."""


def custom_init(args: Any) -> None:
    CALLS.append(("init", (args,), {}))


def before_log_prob(args: Any, model: Any, store_prefix: str) -> None:
    CALLS.append(("log_prob", (args, model, store_prefix), {}))


def before_train_step(
    args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any, opt_param_scheduler: Any
) -> None:
    CALLS.append(("train_step", (args, rollout_id, step_id, model, optimizer, opt_param_scheduler), {}))


def model_provider(
    pre_process: bool, post_process: bool, vp_stage: int | None = None, config: Any = None
) -> Any:
    CALLS.append(
        ("provider", (), {"pre_process": pre_process, "post_process": post_process, "vp_stage": vp_stage})
    )
    from tether.train.model.build import build_chunk

    return build_chunk(PROVIDER_SHAPE["arch"], config, PROVIDER_SHAPE["topo"], transformer_engine=False)


def provider_without_vp_stage(pre_process: bool, post_process: bool) -> Any:
    CALLS.append(("provider", (), {"pre_process": pre_process, "post_process": post_process}))
    return object()


def wrong_train_step_hook(args: Any, model: Any) -> None:
    """Takes slime's log-prob hook's call, not the train-step hook's."""

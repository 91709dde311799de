"""slime's --custom-model-provider-path on a trainer rank: the function that builds each model chunk
in place of tether's GPTModel (`tether.train.model.build.build_chunk`).

As slime calls it: `fn(pre_process=..., post_process=...)`, with `vp_stage=None` too when the
function names `vp_stage` (tether builds one chunk per rank, no virtual pipeline stages). slime's
providers read Megatron-LM's global args, which tether does not have; a function that names
`config` also gets the TransformerConfig tether resolved from --hf-checkpoint and the flags.

What the function returns is then treated as tether's own chunk: Megatron's tensor-parallel
attributes are completed, MTP post-processing is installed when it has an MTP block, it is moved
to the rank's device, and the bridge loads --hf-checkpoint's weights into it by Megatron
parameter name (and exports them by the same names for weight sync), so the model must name and
shape its parameters as Megatron's GPTModel does. The critic's value head replaces its
`output_layer` afterwards, as slime's wrapper does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tether.rollout.hooks.loader import load_function
from tether.runtime.errors import ConfigError

PROVIDER_FLAG = "--custom-model-provider-path"


def provider_kwargs(fn: Any, *, pre_process: bool, post_process: bool, config: Any) -> dict[str, Any]:
    """The keyword arguments `fn` is called with (see the module docstring)."""
    kwargs: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if "vp_stage" in parameters:
        kwargs["vp_stage"] = None
    if "config" in parameters:
        kwargs["config"] = config
    return kwargs


def provide_chunk(path: str, config: Any, *, pre_process: bool, post_process: bool) -> torch.nn.Module:
    """The chunk the provider at `path` builds for this pipeline stage; ConfigError naming the flag
    when it cannot be imported or does not return a module."""
    fn = load_function(path, PROVIDER_FLAG)
    model = fn(**provider_kwargs(fn, pre_process=pre_process, post_process=post_process, config=config))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(PROVIDER_FLAG, path, f"returned {type(model).__name__}, not a torch.nn.Module")
    return model


__all__ = ["PROVIDER_FLAG", "provide_chunk", "provider_kwargs"]

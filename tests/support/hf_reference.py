"""transformers' model of a tiny checkpoint, the reference the engines and the trainer are held to.

MiMo (`model_type: mimo`) has no transformers class (its hub checkpoints ship remote code); its
decoder is Qwen2's and plain decoding ignores its MTP layers, so Qwen2ForCausalLM is its
reference (the MTP tensors are reported as unexpected and left out, as transformers does for
DeepSeek-V3's and GLM-4.5's MTP layers). Kimi-K2 (`model_type: kimi_k2`) has none either: its
config.json is DeepSeek-V3's (architectures DeepseekV3ForCausalLM), which is its reference, loaded
as deepseek_v3 (transformers picks its per-expert → fused-expert weight conversion by model_type and
has none for kimi_k2: the experts would stay at their random init).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def load_causal_lm(model_dir: str | Path) -> Any:
    """transformers' causal LM of `model_dir` in float32, in eval mode."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Qwen2ForCausalLM,
    )
    from transformers.utils import logging

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    cls = {
        "mimo": Qwen2ForCausalLM,
        "kimi_k2": DeepseekV3ForCausalLM,
        # Qwen3.5 as published is a vision-language model; text-only input gives the text logits.
        "qwen3_5": AutoModelForImageTextToText,
        "qwen3_5_moe": AutoModelForImageTextToText,
    }.get(model_type, AutoModelForCausalLM)
    verbosity = logging.get_verbosity()
    # The load report lists every MTP tensor it leaves out (and a relabelled family's model_type).
    logging.set_verbosity_error()
    try:
        kwargs: dict[str, Any] = {}
        if model_type == "kimi_k2":
            kwargs["config"] = DeepseekV3Config.from_pretrained(str(model_dir))
            kwargs["config"].model_type = "deepseek_v3"
        return cls.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs).eval()
    finally:
        logging.set_verbosity(verbosity)

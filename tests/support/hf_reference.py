"""transformers' model of a tiny checkpoint, the reference the engines and the trainer are held to.

MiMo (`model_type: mimo`) has no transformers class (its hub checkpoints ship remote code); its
decoder is Qwen2's and plain decoding ignores its MTP layers, so Qwen2ForCausalLM is its
reference (the MTP tensors are reported as unexpected and left out, as transformers does for
DeepSeek-V3's and GLM-4.5's MTP layers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def load_causal_lm(model_dir: str | Path) -> Any:
    """transformers' causal LM of `model_dir` in float32, in eval mode."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    from transformers.utils import logging

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    cls = Qwen2ForCausalLM if model_type == "mimo" else AutoModelForCausalLM
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists every MTP tensor it leaves out
    try:
        return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    finally:
        logging.set_verbosity(verbosity)

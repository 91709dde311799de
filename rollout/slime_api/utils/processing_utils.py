"""`slime.utils.processing_utils`: the tokenizer and (multimodal) processor loaders hooks call.

tether trains on text only, so `load_processor` answers None for every model, as slime's does for a
text-only one (where AutoProcessor would hand back a bare tokenizer).
"""

from __future__ import annotations

from typing import Any


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """The model's Hugging Face tokenizer: AutoTokenizer's, its class remembered between runs
    for a local directory (`tether.rollout.data.tokenizer_choice`)."""
    from tether.rollout.data.tokenizer_choice import load_tokenizer as load

    return load(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> None:
    """None: tether has no multimodal inputs (see the module docstring)."""
    del name_or_path, kwargs
    return None


__all__ = ["load_processor", "load_tokenizer"]

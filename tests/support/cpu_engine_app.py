"""The CPU engine's scheduler built in-process on the host, for tests that drive its HTTP app
without starting a server process."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from tether.rollout.cpu_engine.modeling.model import ModelConfig, TinyLM, read_safetensors_dir
from tether.rollout.cpu_engine.scheduler import Scheduler


def host_scheduler(
    model_dir: str, *, weight_version: str = "v1", context_length: int = 64, max_running: int = 2
) -> Scheduler:
    """A greedy-capable scheduler over `model_dir`'s weights on the host (seed 0)."""
    cfg = ModelConfig.from_dir(model_dir)
    return Scheduler(
        cfg,
        TinyLM(cfg, read_safetensors_dir(model_dir)),
        Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")),
        weight_version=weight_version,
        context_length=context_length,
        max_running=max_running,
        original_logprob=False,
        seed=0,
    )

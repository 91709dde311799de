"""The embedded CPU engine: an inference server we run, speaking SGLang's native HTTP API.

It is not part of rollout's logic: rollout talks to it, as to SGLang, only over HTTP through
tether.rollout.engine_api. One entry: `python -m tether.rollout.cpu_engine` (`tether engine`),
whose flags `add_arguments` declares and `main` serves.

    server.py      process entry: flags, API key, serve until a stop signal
    http_api.py    the endpoints (generate, weights, memory, health) and their limits
    scheduler.py   continuous batching of requests over the model
    model.py       the decoder (Llama, Qwen2, Qwen3) in plain torch, loaded from safetensors
    sampling.py    SGLang's sampling parameters and the sampler
    receive.py     receiving weight buckets broadcast by the trainer
    tiny_model.py  `tether init-model`: small random Hugging Face models and tokenizers
"""

from tether.rollout.cpu_engine.server import SchedulerFailed, add_arguments, main, serve

__all__ = ["SchedulerFailed", "add_arguments", "main", "serve"]

"""The embedded CPU engine: an inference server we run, speaking SGLang's native HTTP API.

It is not part of rollout's logic: rollout talks to it, as to SGLang, only over HTTP through
tether.rollout.engine_api. One entry: `python -m tether.rollout.cpu_engine` (`tether engine`),
whose flags `add_arguments` declares and `main` serves.

    server.py          process entry: flags, API key, serve until a stop signal
    scheduler.py       continuous batching of requests over the model
    sampling.py        SGLang's sampling parameters and the sampler
    constrained.py     grammar-constrained decoding (JSON schema, regex, EBNF)
    prompt_logprobs.py log-probs of the prompt's tokens
    http/              the endpoints: SGLang's native API (sglang_api.py), the OpenAI one
                       (openai_api.py), what they share (common.py: state, limits, refusals)
    modeling/          the decoder in plain torch (model.py, mla.py, moe.py, rope.py) and
                       `tether init-model`'s small random models (tiny_model.py)
    weights/           weight updates: broadcast buckets (receive.py), disk streams, the checker
"""

from tether.rollout.cpu_engine.server import SchedulerFailed, add_arguments, main, serve

__all__ = ["SchedulerFailed", "add_arguments", "main", "serve"]

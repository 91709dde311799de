"""`tether engine` / `python -m tether.rollout.cpu_engine`: the embedded CPU engine.

A small inference server that speaks SGLang's native HTTP API (see engine_http.py) for the
Llama, Qwen2 and Qwen3 models `tether init-model` writes, so every client path of tether runs
on a CPU-only machine. Readiness: GET /health answers 200 once the model has loaded.

The --test-delay-* flags are for tests and benchmarks only: each request waits a seeded random
delay before it joins the batch, to imitate long-tail engines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from tether.runtime.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory (safetensors).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=30000, help="Port to listen on.")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (the engine shares cores)."
    )
    parser.add_argument(
        "--context-length", type=int, default=None, help="Context length (default: the model's)."
    )
    parser.add_argument("--max-running-requests", type=int, default=128, help="Largest decode batch.")
    parser.add_argument("--weight-version", default="default", help="Weight version reported at start.")
    parser.add_argument("--random-seed", type=int, default=0, help="Seed for requests without sampling_seed.")
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        default=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"),
        help="Report log-probs before temperature scaling (SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB).",
    )
    parser.add_argument(
        "--test-delay-distribution",
        choices=["none", "constant", "exponential", "lognormal"],
        default="none",
        help="TESTS/BENCHMARKS ONLY: distribution of a per-request delay before a request joins the batch.",
    )
    parser.add_argument("--test-delay-mean-ms", type=float, default=0.0, help="TESTS ONLY: mean delay (ms).")
    parser.add_argument("--test-delay-sigma", type=float, default=1.0, help="TESTS ONLY: lognormal sigma.")
    parser.add_argument("--test-delay-seed", type=int, default=0, help="TESTS ONLY: delay RNG seed.")


def _check(args: argparse.Namespace) -> None:
    for flag, value, ok, why in (
        ("--threads", args.threads, args.threads >= 1, "must be at least 1"),
        ("--port", args.port, 0 < args.port < 65536, "must be a TCP port"),
        ("--max-running-requests", args.max_running_requests, args.max_running_requests >= 1, "must be >= 1"),
        ("--test-delay-mean-ms", args.test_delay_mean_ms, args.test_delay_mean_ms >= 0, "must be >= 0"),
        ("--test-delay-sigma", args.test_delay_sigma, args.test_delay_sigma >= 0, "must be >= 0"),
    ):
        if not ok:
            raise ConfigError(flag, value, why)


async def serve(args: argparse.Namespace) -> None:
    import torch
    from aiohttp import web
    from tokenizers import Tokenizer

    from tether.rollout.engine_http import DelaySampler, EngineState, make_app
    from tether.rollout.engine_model import ModelConfig, TinyLM, read_safetensors_dir
    from tether.rollout.engine_scheduler import Scheduler

    torch.set_num_threads(args.threads)
    cfg = await asyncio.to_thread(ModelConfig.from_dir, args.model_path)
    context = args.context_length or cfg.max_position
    if not 1 < context <= cfg.max_position:
        raise ConfigError("--context-length", context, f"must be in (1, {cfg.max_position}] for this model")
    named = await asyncio.to_thread(read_safetensors_dir, args.model_path)
    model = TinyLM(cfg, named)
    tokenizer = Tokenizer.from_file(os.path.join(args.model_path, "tokenizer.json"))
    scheduler = Scheduler(
        cfg,
        model,
        tokenizer,
        weight_version=args.weight_version,
        context_length=context,
        max_running=args.max_running_requests,
        original_logprob=args.return_original_logprob,
        seed=args.random_seed,
    )
    delay = DelaySampler(
        args.test_delay_distribution,
        args.test_delay_mean_ms / 1000.0,
        args.test_delay_sigma,
        args.test_delay_seed,
    )
    state = EngineState(
        scheduler=scheduler,
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        delay=delay,
        disk_path=args.model_path,
        disk_version=args.weight_version,
    )
    runner = web.AppRunner(make_app(state), access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"tether cpu engine serving {args.model_path} on http://{args.host}:{args.port}", flush=True)
        await stop.wait()
    finally:
        if state.receiving:
            # A collective waiting for a sender that is gone holds its thread until the group's
            # timeout (minutes), and interpreter exit would wait for that thread: leave now.
            print("tether cpu engine: stopping during a weight receive; exiting at once", flush=True)
            os._exit(0)
        await runner.cleanup()


def main(args: argparse.Namespace) -> int:
    import uvloop

    _check(args)
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tether.rollout.cpu_engine", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

"""The CPU engine's process: flags, the API key, and serving until a stop signal.

A small inference server that speaks SGLang's native HTTP API (see http_api.py) for the
Llama, Qwen2 and Qwen3 models `tether init-model` writes, so every client path of tether runs
on a CPU-only machine. With --device cuda the same engine runs on a GPU (weights, KV cache and
sampling on it, in --dtype), and /release_memory_occupation hands that GPU's memory back, so a
colocated run needs no SGLang. Readiness: GET /health answers 200 once the model has loaded.

Every endpoint but GET /health requires the engine's API key as `Authorization: Bearer <key>`;
the key comes from TETHER_ENGINE_API_KEY (how tether hands it over) or --api-key-file, and the
engine does not start without one, unless --no-api-key asks for an open server on a loopback
address (a standalone server whose clients send no key, e.g. slime's on-policy distillation teacher
at --rm-url; tether's launcher never passes it). If the scheduler fails, the process exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tether.runtime.errors import ConfigError

if TYPE_CHECKING:
    import torch

_SGLANG_HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
DEVICES = ("cpu", "cuda")
# SGLang's --dtype spellings, by the dtype each names (auto is resolved by `resolve_dtype`).
DTYPES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


class SchedulerFailed(RuntimeError):
    """The engine's scheduler loop ended with an error; the engine cannot generate any more."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory (safetensors).")
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="Where the weights, the KV cache and sampling live: cpu, or cuda (the first GPU "
        "CUDA_VISIBLE_DEVICES leaves visible; then /release_memory_occupation frees its memory).",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="SGLang's flag: the dtype of the weights and activations. auto: on cuda as SGLang "
        "(the checkpoint's dtype, float16 for a float32 checkpoint); on cpu float32, the only "
        "dtype the CPU device computes in.",
    )
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
        "--api-key-file",
        default=None,
        help="File (one line, readable by its owner only) holding the API key every endpoint but "
        "GET /health requires as 'Authorization: Bearer <key>'. Default: the TETHER_ENGINE_API_KEY "
        "environment variable, which is how tether passes it; without either the engine does not start.",
    )
    parser.add_argument(
        "--no-api-key",
        action="store_true",
        help="Serve without authentication, as SGLang does by default; refused unless --host is a "
        "loopback address (only processes on this machine can reach it) and without a key given.",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 << 20,
        help="Largest request body in bytes; a larger one is refused with 413.",
    )
    parser.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=512,
        help="Most prompts one /generate request may carry (batched text or input_ids).",
    )
    parser.add_argument(
        "--health-check-timeout",
        type=float,
        default=float(os.environ.get(_SGLANG_HEALTH_TIMEOUT_ENV) or 20.0),
        help="Seconds /health_generate waits for the scheduler to make progress before answering 503 "
        "(default: SGLang's SGLANG_HEALTH_CHECK_TIMEOUT, else 20).",
    )
    parser.add_argument(
        "--weight-group-setup-timeout",
        type=float,
        default=60.0,
        help="Seconds /init_weights_update_group waits for the trainer's rendezvous before failing.",
    )
    parser.add_argument(
        "--max-weight-group-setups",
        type=int,
        default=2,
        help="Weight-group joins in progress at once; more are refused with 503.",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="The model's name in /v1/models (default: --model-path), as SGLang's flag of that name.",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=["qwen25", "qwen", "hermes"],
        default=None,
        help="Tool-call format of the model (SGLang's parser names): /v1/chat/completions parses calls "
        "into message.tool_calls and constrains tool_choice 'required' or a named function to it.",
    )
    parser.add_argument(
        "--allow-nonfinite-weights",
        action="store_true",
        help="Accept weight updates holding NaN or inf (refused by default with 400 naming the tensor).",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="Record the experts each token is routed to, so /generate with return_routed_experts "
        "returns them (SGLang's flag; MoE models only).",
    )


def _check(args: argparse.Namespace) -> None:
    if args.device == "cpu" and DTYPES.get(args.dtype, "float32") != "float32":
        raise ConfigError("--dtype", args.dtype, "the cpu device computes in float32; use --device cuda")
    for flag, value, ok, why in (
        ("--threads", args.threads, args.threads >= 1, "must be at least 1"),
        ("--port", args.port, 0 < args.port < 65536, "must be a TCP port"),
        ("--max-running-requests", args.max_running_requests, args.max_running_requests >= 1, "must be >= 1"),
        ("--max-request-bytes", args.max_request_bytes, args.max_request_bytes >= 1024, "must be >= 1024"),
        (
            "--max-prompts-per-request",
            args.max_prompts_per_request,
            args.max_prompts_per_request >= 1,
            "must be >= 1",
        ),
        ("--health-check-timeout", args.health_check_timeout, args.health_check_timeout > 0, "must be > 0"),
        (
            "--weight-group-setup-timeout",
            args.weight_group_setup_timeout,
            args.weight_group_setup_timeout > 0,
            "must be > 0",
        ),
        (
            "--max-weight-group-setups",
            args.max_weight_group_setups,
            args.max_weight_group_setups >= 1,
            "must be >= 1",
        ),
    ):
        if not ok:
            raise ConfigError(flag, value, why)


def check_model_path(path: str) -> None:
    """--model-path must be a model directory (the engine would exit at load otherwise)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            "--model-path",
            path,
            "holds no config.json; pass a Hugging Face model directory (config.json, tokenizer.json, "
            "*.safetensors), e.g. one `tether init-model --out DIR` writes",
        )


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file or TETHER_ENGINE_API_KEY; the variable leaves this process's
    environment, so nothing the engine starts inherits it. None with --no-api-key (loopback only)."""
    import ipaddress

    from tether.rollout.engine_api.auth import ENGINE_KEY_ENV, key_from_env
    from tether.runtime.rpc.secret import read_key_file

    from_env = key_from_env()
    os.environ.pop(ENGINE_KEY_ENV, None)
    if getattr(args, "no_api_key", False):
        if args.api_key_file is not None or from_env is not None:
            raise ConfigError(
                "--no-api-key", True, f"a key was given too (--api-key-file or {ENGINE_KEY_ENV})"
            )
        try:
            loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(
                "--no-api-key",
                True,
                f"--host={args.host} is not a loopback address; an open engine "
                "must be reachable from this machine only",
            )
        return None
    if args.api_key_file is not None:
        return read_key_file(args.api_key_file, "--api-key-file")
    if from_env is None:
        raise ConfigError(
            "--api-key-file",
            None,
            f"the engine needs an API key: set {ENGINE_KEY_ENV} or pass --api-key-file "
            "(every endpoint but /health requires it)",
        )
    return from_env


def resolve_dtype(flag: str, device: str, model_path: str) -> torch.dtype:
    """The dtype --dtype `flag` means on `device` for the checkpoint at `model_path`: auto is
    float32 on cpu and, on cuda, SGLang's rule (the dtype config.json declares; float16 for a
    float32 checkpoint)."""
    import torch

    from tether.rollout.cpu_engine.modeling.model import checkpoint_dtype

    if flag != "auto":
        dtype: torch.dtype = getattr(torch, DTYPES[flag])
        return dtype
    if device == "cpu":
        return torch.float32
    stored = checkpoint_dtype(model_path)
    return torch.float16 if stored == torch.float32 else stored


def engine_device(name: str) -> torch.device:
    """The torch device --device `name` means: cuda is the current GPU (index 0 of those
    CUDA_VISIBLE_DEVICES leaves); every tensor of the engine names it explicitly."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device",
            name,
            "CUDA is not available to this process (torch.cuda.is_available() is False: no visible GPU, "
            "or a CPU-only torch build)",
        )
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def _collective_interfaces() -> str:
    """The interfaces its weight-update groups will use, as the node agent set them (a forked
    engine's environment does not show in /proc/PID/environ)."""
    from tether.runtime.netif import GLOO_IFNAME_ENV, NCCL_IFNAME_ENV

    named = [f"{k}={os.environ[k]}" for k in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV) if os.environ.get(k)]
    return f"; collectives: {' '.join(named)}" if named else ""


async def serve(args: argparse.Namespace, delay: Callable[[], float] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; `delay` (benchmarks and tests only) draws the seconds each
    request waits before it joins the batch."""
    from tether.runtime.process.gc_tuning import imports_without_gc

    with imports_without_gc():
        import torch
        from aiohttp import web
        from tokenizers import Tokenizer

        from tether.rollout.cpu_engine.http.common import EngineLimits, EngineState
        from tether.rollout.cpu_engine.http.sglang_api import make_app
        from tether.rollout.cpu_engine.modeling.model import ModelConfig, TinyLM, read_safetensors_dir
        from tether.rollout.cpu_engine.scheduler import Scheduler

    torch.set_num_threads(args.threads)
    device = engine_device(args.device)
    dtype = await asyncio.to_thread(resolve_dtype, args.dtype, args.device, args.model_path)
    cfg = await asyncio.to_thread(ModelConfig.from_dir, args.model_path)
    context = args.context_length or cfg.max_position
    if not 1 < context <= cfg.max_position:
        raise ConfigError("--context-length", context, f"must be in (1, {cfg.max_position}] for this model")
    if args.enable_return_routed_experts and cfg.moe is None:
        raise ConfigError(
            "--enable-return-routed-experts",
            True,
            f"model_type={cfg.model_type!r} has no MoE layers to report",
        )
    named = await asyncio.to_thread(read_safetensors_dir, args.model_path)
    model = TinyLM(cfg, named, device, dtype)
    del named  # the host copy; on cuda the weights now live on the GPU
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
        return_routed_experts=args.enable_return_routed_experts,
    )
    state = EngineState(
        scheduler=scheduler,
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        delay=delay or _no_delay,
        disk_path=args.model_path,
        disk_version=args.weight_version,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        limits=EngineLimits(
            max_request_bytes=args.max_request_bytes,
            max_prompts_per_request=args.max_prompts_per_request,
            health_timeout=args.health_check_timeout,
            group_setup_timeout=args.weight_group_setup_timeout,
            max_group_setups=args.max_weight_group_setups,
            allow_nonfinite_weights=args.allow_nonfinite_weights,
        ),
    )
    runner = web.AppRunner(make_app(state), access_log=None, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    failures: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:
        # The scheduler is gone (every request was ended with its error): stop serving and exit
        # non-zero, so the owner replaces this engine instead of routing to one that never answers.
        failures.append(error)
        stop.set()

    state.on_fatal = on_fatal

    def on_stop_signal(sig: signal.Signals) -> None:
        # How the supervisor ends an engine: one line, then exit 0 (not an error).
        if not stop.is_set():
            print(f"tether cpu engine: stopping ({sig.name})", flush=True)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal, sig)
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        print(
            f"tether cpu engine serving {args.model_path} on http://{args.host}:{args.port} "
            f"({device.type}, {str(dtype).removeprefix('torch.')}){_collective_interfaces()}",
            flush=True,
        )
        await stop.wait()
    finally:
        if state.receiving or state.group_setups:
            # A collective waiting for a sender that is gone holds its thread until the group's
            # timeout (minutes), a rendezvous with a peer that never answers for good, and
            # interpreter exit would wait for that thread: leave now.
            print(
                "tether cpu engine: stopping during a weight receive or group join; exiting at once",
                flush=True,
            )
            os._exit(1 if failures else 0)
        await runner.cleanup()
    if failures:
        raise SchedulerFailed(f"{type(failures[0]).__name__}: {failures[0]}") from failures[0]


def _no_delay() -> float:
    return 0.0


def main(args: argparse.Namespace, delay: Callable[[], float] | None = None) -> int:
    import uvloop

    _check(args)
    check_model_path(args.model_path)
    args.api_key = _api_key(args)
    try:
        uvloop.run(serve(args, delay))
    except SchedulerFailed as e:
        print(f"tether cpu engine: exiting, the scheduler failed: {e}", file=sys.stderr, flush=True)
        return 1
    return 0

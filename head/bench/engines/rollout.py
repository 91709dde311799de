"""`tether bench rollout --json`: synchronous rollout vs the fully-async worker against long-tail CPU engines.

Both modes do the same work in the same run: `--rollouts` rollouts of `--batch-groups` groups of
`--n-samples` samples, each followed by a simulated train step of `--train-seconds` (engines
idle in the synchronous mode, keep generating in the fully-async one). The engines add a seeded
heavy-tailed (lognormal) per-request delay. Reported: samples/s and engine busy fraction (time an
engine has at least one request in flight, over wall time, averaged over engines), and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tether.bench.compare import with_comparison
from tether.bench.engines.launch import cpu_engines
from tether.bench.engines.slow_engine import delay_argv
from tether.rollout.config import DataConfig, RolloutConfig
from tether.rollout.data.source import DataSource, PromptRecord, load_tokenizer
from tether.rollout.engine_api.auth import new_engine_key
from tether.rollout.engine_api.client import EngineClient
from tether.rollout.fully_async import FullyAsyncWorker
from tether.rollout.rollout_fn import RolloutContext, run_rollout, using_context
from tether.rollout.routing.router import Router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print one JSON object (the default output).")
    parser.add_argument("--engines", type=int, default=2, help="CPU engine processes.")
    parser.add_argument("--rollouts", type=int, default=4, help="Rollouts per mode.")
    parser.add_argument("--batch-groups", type=int, default=8, help="Groups per rollout.")
    parser.add_argument("--n-samples", type=int, default=4, help="Samples per group.")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Response length cap.")
    parser.add_argument("--delay-mean-ms", type=float, default=300.0, help="Mean per-request engine delay.")
    parser.add_argument("--delay-sigma", type=float, default=1.5, help="Lognormal sigma of the delay (tail).")
    parser.add_argument("--train-seconds", type=float, default=0.5, help="Simulated train step per rollout.")
    parser.add_argument(
        "--in-flight", type=int, default=None, help="Fully-async in-flight groups (default 2x)."
    )
    parser.add_argument("--model-path", default=None, help="Model directory (default: a fresh tiny model).")


class _Config:
    """The slices the rollout reads (the bench needs no trainer config)."""

    def __init__(self, rollout: RolloutConfig, data: DataConfig) -> None:
        self.rollout, self.data = rollout, data


async def _measure(
    mode: str, args: argparse.Namespace, urls: list[str], model: str, key: str
) -> dict[str, float]:
    rollout = RolloutConfig(rollout_max_response_len=args.max_new_tokens, rm_type="exact_match")
    data = DataConfig(rollout_batch_size=args.batch_groups, n_samples_per_prompt=args.n_samples)
    tok = load_tokenizer(model)
    prompts = [
        PromptRecord(prompt=f"q{i}", tokens=tok.encode(f"question {i}", add_special_tokens=False), label="x")
        for i in range(256)
    ]
    ds = DataSource(prompts, n_samples_per_prompt=args.n_samples)
    clients = [EngineClient(u, name=f"e{i}", api_key=key) for i, u in enumerate(urls)]
    router = Router(clients, policy="least_in_flight")
    samples = 0
    async with RolloutContext(_Config(rollout, data), router) as ctx:
        start = time.monotonic()
        busy0 = sum(router.busy_seconds().values())
        with using_context(ctx):
            if mode == "sync":
                for r in range(args.rollouts):
                    groups = await run_rollout(ctx, r, ds)
                    samples += sum(len(g) for g in groups)
                    await asyncio.sleep(args.train_seconds)  # the simulated train step
            else:
                cap = args.in_flight or 2 * args.batch_groups
                async with FullyAsyncWorker(ctx, ds, max_in_flight=cap) as worker:
                    for r in range(args.rollouts):
                        groups = await worker.get_batch(args.batch_groups, r)
                        samples += sum(len(g) for g in groups)
                        await asyncio.sleep(args.train_seconds)
                    wall = time.monotonic() - start
                    busy = sum(router.busy_seconds().values()) - busy0
                    return _figures(samples, wall, busy, len(urls))
        wall = time.monotonic() - start
        busy = sum(router.busy_seconds().values()) - busy0
    return _figures(samples, wall, busy, len(urls))


def _figures(samples: int, wall: float, busy: float, engines: int) -> dict[str, float]:
    return {
        "samples": float(samples),
        "seconds": round(wall, 3),
        "samples_per_s": round(samples / wall, 3),
        "engine_busy_fraction": round(busy / (engines * wall), 4),
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from tether.rollout.cpu_engine.modeling.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="tether-bench-rollout-") as tmp:
        model = args.model_path or str(write_tiny_model(Path(tmp) / "model"))
        key = new_engine_key()
        slow = lambda i: delay_argv("lognormal", args.delay_mean_ms, args.delay_sigma, seed=i)  # noqa: E731
        async with cpu_engines(
            model, key, args.engines, module="tether.bench.engines.slow_engine", extra=slow
        ) as urls:
            sync = await _measure("sync", args, urls, model, key)
            fully = await _measure("fully_async", args, urls, model, key)
    return {
        "benchmark": "rollout",
        "engines": args.engines,
        "delay": {"distribution": "lognormal", "mean_ms": args.delay_mean_ms, "sigma": args.delay_sigma},
        "train_seconds": args.train_seconds,
        "sync": sync,
        "fully_async": fully,
        "throughput_ratio": round(fully["samples_per_s"] / sync["samples_per_s"], 3),
        "targets": {"throughput_ratio": 2.0, "fully_async_engine_busy_fraction": 0.9},
    }


def main(args: argparse.Namespace) -> int:
    import uvloop

    result = uvloop.run(_bench(args))
    print(json.dumps(with_comparison(result, args), indent=None if args.json else 2))
    return 0

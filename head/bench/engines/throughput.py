"""`tether bench engine`: CPU engine throughput at 1, 8 and 64 concurrent requests, and weight
reload time from disk, on the default `tether init-model` model. Prints JSON.

Each level sends `concurrency` requests of `--new-tokens` tokens at once (ignore_eos, so every
request generates exactly that many) and reports generated tokens per wall-clock second; the
ratio of the 64-request level to the single request is the batching gain (target: >= 5x).
`starts`: launch to serving, spawned as a fresh interpreter against forked from the node's
secret-less zygote (tether.bench.engines.start), `--starts` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tether.bench.compare import with_comparison
from tether.bench.engines.launch import cpu_engines
from tether.rollout.engine_api.auth import bearer_header, new_engine_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print only the JSON result.")
    parser.add_argument("--levels", default="1,8,64", help="Comma-separated concurrency levels.")
    parser.add_argument("--new-tokens", type=int, default=64, help="New tokens per request.")
    parser.add_argument("--reloads", type=int, default=5, help="update_weights_from_disk calls to time.")
    parser.add_argument("--threads", type=int, default=1, help="Engine torch threads.")
    parser.add_argument("--model-path", default=None, help="Model to serve (default: a fresh init-model).")
    parser.add_argument(
        "--starts", type=int, default=3, help="Rounds of engine starts, spawned and forked (0: none)."
    )


async def _level(
    session: aiohttp.ClientSession, url: str, concurrency: int, new_tokens: int
) -> dict[str, Any]:
    sp = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def one(i: int) -> int:
        payload = {"input_ids": [1, 2, 3, 4 + i % 200], "sampling_params": {**sp, "sampling_seed": i}}
        async with session.post(url + "/generate", json=payload) as r:
            body = await r.json()
            return int(body["meta_info"]["completion_tokens"])

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i)) for i in range(concurrency)]
    elapsed = time.perf_counter() - start
    tokens = sum(t.result() for t in tasks)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


async def _bench(args: argparse.Namespace, model_path: str, log_dir: Path) -> dict[str, Any]:
    key = new_engine_key()
    threads = lambda i: ["--threads", str(args.threads)]  # noqa: E731
    async with cpu_engines(model_path, key, extra=threads, log_dir=log_dir) as (url,):
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600), headers=bearer_header(key)
        ) as session:
            await _level(session, url, 4, 8)  # warm-up: first-call allocations and code paths
            levels = [await _level(session, url, int(c), args.new_tokens) for c in args.levels.split(",")]
            reloads = []
            for i in range(args.reloads):
                start = time.perf_counter()
                async with session.post(
                    url + "/update_weights_from_disk",
                    json={"model_path": model_path, "weight_version": f"r{i}"},
                ) as r:
                    if r.status != 200:
                        raise RuntimeError(f"reload failed: {await r.text()}")
                reloads.append(time.perf_counter() - start)
    by_c = {lv["concurrency"]: lv["tokens_per_s"] for lv in levels}
    result: dict[str, Any] = {
        "bench": "engine",
        "model_path": model_path,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "levels": levels,
        "disk_reload_s": {"mean": sum(reloads) / len(reloads), "min": min(reloads), "max": max(reloads)},
    }
    if args.starts > 0:
        from tether.bench.engines.start import engine_starts

        result["starts"] = await engine_starts(model_path, args.starts, log_dir / "starts")
    if 1 in by_c and 64 in by_c:
        result["ratio_64_vs_1"] = by_c[64] / by_c[1]
        result["target_ratio"] = 5.0
        result["meets_target"] = result["ratio_64_vs_1"] >= 5.0
    return result


def main(args: argparse.Namespace) -> int:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="tether-bench-engine-") as tmp:
        model_path = args.model_path
        if model_path is None:
            from tether.rollout.cpu_engine.modeling.tiny_model import write_tiny_model

            model_path = os.fspath(write_tiny_model(Path(tmp) / "model"))
        result = uvloop.run(_bench(args, model_path, Path(tmp)))
    print(json.dumps(with_comparison(result, args), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tether.bench.engines.throughput", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

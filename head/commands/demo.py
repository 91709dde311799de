"""`tether demo`: on a CPU-only machine, a tiny model learns to sort digits with GRPO.

Four phases, each through the real stack (supervisor, placement, Megatron ranks, CPU engine,
ZeroMQ, a weight-sync transport):
  1. make a tiny Llama (byte-level tokenizer) and the task's prompts (train / held-out / dev);
  2. a supervised warm-up with sft_loss on saved rollouts of correct answers; the engine
     evaluates the initial model first and the model every SFT_EVAL_INTERVAL steps, and the
     warm-up stops at the first evaluation whose greedy reward reaches --warmup-target (the
     reward jumps from ~0 to ~0.7 within ~10 steps once answers form, so a fixed step count
     would hand GRPO anything from 0.05 to 0.4 depending on the seed); the run writes the
     warmed-up model as an HF checkpoint;
  3. GRPO: `tether run` with CPU engines, Megatron ranks (DP=2 by default, or TP=2) and a
     weight-sync transport, evaluating on held-out prompts until the reward reaches --target;
  4. curves: reward.png and curves.png beside the metrics, and a summary.

Recipe (`Recipe`, measured on 2 shared cores): warm-up at lr 1e-3 x 64 examples until the
greedy reward is >= 0.1 (lands at 0.10-0.20), then GRPO with 16 prompts x 8 samples at
temperature 0.5 (at 1.0 the 320-token vocabulary's tail makes nearly every sample malformed,
so there is no signal; at 0.7 a start of 0.10 needed 300 steps instead of 100), Adam lr 5e-4
after a 10-step warm-up, gradient clip 1.0. Seeds 1-5 reach 0.85-1.0 held-out after 60-100
GRPO steps, 1-3 minutes of wall time in all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tether.commands import demo_task
from tether.config import resolve
from tether.records.run_dir import live_metrics, read_jsonl
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.rollout.debug_dump import save_rollout
from tether.rollout.sample import Sample, SampleStatus
from tether.runtime.errors import ConfigError
from tether.runtime.files.atomic_file import write_bytes_atomic


@dataclass(frozen=True)
class Recipe:
    """The demo's training recipe; every field has a flag of the same name."""

    sft_steps: int = 60  # at most; the warm-up stops once the model starts to score
    warmup_target: float = 0.1
    sft_batch: int = 64
    sft_lr: float = 1e-3
    prompts: int = 16  # GRPO prompts per step
    samples: int = 8  # samples per prompt (the GRPO group)
    lr: float = 5e-4
    lr_warmup: int = 10
    temperature: float = 0.5
    entropy_coef: float = 0.0


PORT_LAST = 32767
SFT_EVAL_INTERVAL = 2  # warm-up steps between evaluations (the reward rises fast once answers form)
DEV_PROMPTS = 200  # training prompts outside the warm-up's pool, evaluated beside the held-out ones


def add_weight_sync_arguments(parser: argparse.ArgumentParser, transport_help: str) -> None:
    """The weight-sync flags the demo and `tether bench e2e` pass on to `tether run`."""
    parser.add_argument(
        "--update-weight-transport", choices=["disk", "nccl"], default="disk", help=transport_help
    )
    parser.add_argument(
        "--update-weight-mode", choices=["full", "delta"], default="full", help="Full or delta sync."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    r = Recipe()
    parser.add_argument(
        "--out", type=Path, default=None, help="Directory for everything (default runs/demo-<time>)."
    )
    parser.add_argument(
        "--loop", choices=["sync", "async", "fully-async"], default="sync", help="Training loop."
    )
    add_weight_sync_arguments(parser, "How weights reach the engine (nccl means gloo on CPU).")
    parser.add_argument(
        "--parallel", choices=["dp2", "tp2"], default="dp2", help="Trainer layout on 2 ranks."
    )
    parser.add_argument("--max-steps", type=int, default=600, help="GRPO steps at most.")
    parser.add_argument(
        "--target", type=float, default=0.8, help="Stop once the held-out reward reaches this."
    )
    parser.add_argument("--seed", type=int, default=1, help="Seed for the model, data order and sampling.")
    parser.add_argument("--eval-interval", type=int, default=20, help="Evaluate every this many GRPO steps.")
    parser.add_argument("--eval-prompts", type=int, default=500, help="Held-out prompts per evaluation.")
    recipe = parser.add_argument_group("recipe")
    recipe.add_argument(
        "--sft-steps", type=int, default=r.sft_steps, help="Supervised warm-up steps at most (0 skips it)."
    )
    recipe.add_argument(
        "--warmup-target",
        type=float,
        default=r.warmup_target,
        help="Stop the warm-up at this mean reward (held-out and dev prompts, greedy).",
    )
    recipe.add_argument("--sft-batch", type=int, default=r.sft_batch, help="Examples per warm-up step.")
    recipe.add_argument("--sft-lr", type=float, default=r.sft_lr, help="Warm-up learning rate.")
    recipe.add_argument("--prompts", type=int, default=r.prompts, help="GRPO prompts per step.")
    recipe.add_argument("--samples", type=int, default=r.samples, help="Samples per prompt (the GRPO group).")
    recipe.add_argument("--lr", type=float, default=r.lr, help="GRPO learning rate.")
    recipe.add_argument(
        "--lr-warmup", type=int, default=r.lr_warmup, help="GRPO learning-rate warm-up steps."
    )
    recipe.add_argument(
        "--temperature", type=float, default=r.temperature, help="Rollout sampling temperature."
    )
    recipe.add_argument("--entropy-coef", type=float, default=r.entropy_coef, help="GRPO entropy bonus.")


def make_model(out: Path, seed: int) -> Path:
    spec = TinyModelSpec(
        arch="llama",
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=4,
        intermediate=256,
        tie_embeddings=True,
        bpe_merges=0,
        seed=seed,
    )
    return write_tiny_model(out / "model", spec)


def write_sft_rollouts(out: Path, model: Path, train: list[str], steps: int, per_step: int, seed: int) -> str:
    """Correct answers to a quarter of the training prompts, one saved rollout per SFT step."""
    from transformers import AutoTokenizer  # seconds to import: not for `tether demo --help`

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    pool = train[: len(train) // 4]
    template = str(out / "sft" / "rollout_{rollout_id}.msgpack")
    (out / "sft").mkdir(parents=True, exist_ok=True)
    index = 0
    for step in range(steps):
        group = []
        for digits in rng.sample(pool, per_step):
            prompt = tok.encode(demo_task.PROMPT_TEMPLATE.format(digits=digits), add_special_tokens=False)
            answer = [*tok.encode(demo_task.target(digits), add_special_tokens=False), tok.eos_token_id]
            group.append(
                [
                    Sample(
                        index=index,
                        group_index=index,
                        rollout_id=index,
                        prompt=digits,
                        tokens=prompt + answer,
                        response=demo_task.target(digits),
                        response_length=len(answer),
                        label=digits,
                        reward=0.0,
                        loss_mask=[1] * len(answer),
                        rollout_log_probs=[0.0] * len(answer),
                        status=SampleStatus.COMPLETED,
                    )
                ]
            )
            index += 1
        save_rollout(template, step, group)
    return template


def port_base() -> int:
    """A random first port for this demo's runs.

    The job moves a plan's ports past any that are taken, but two demos started at the same
    moment would check the same default range together; a random base keeps them apart.
    """
    # Below Linux's ephemeral range (32768-60999): a client socket could take a port there
    # between the job's check and the bind.
    return random.Random(os.getpid() ^ time.time_ns()).randrange(10000, 32000, 32)


def common_flags(args: argparse.Namespace, out: Path) -> list[str]:
    parallel = ["--tensor-model-parallel-size", "2"] if args.parallel == "tp2" else []
    first = port_base()
    return [
        "--node-port-first",
        str(first),
        "--node-port-last",
        str(PORT_LAST),
        "--cpu-devices",
        "3",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--rollout-num-gpus",
        "1",
        "--rollout-engine",
        "cpu",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "8192",
        "--clip-grad",
        "1.0",
        "--seed",
        str(args.seed),
        "--progress",
        "auto",
        *parallel,
        "--prompt-data",
        str(out / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--eval-temperature",
        "0",
        "--custom-rm-path",
        "tether.commands.demo_task.reward",
        "--rollout-max-response-len",
        "8",
        "--rollout-temperature",
        str(args.temperature),
    ]


def sft_argv(args: argparse.Namespace, out: Path, model: Path, template: str, sft_model: Path) -> list[str]:
    """The warm-up run: trains on saved rollouts; the engine evaluates before the first and after the last step."""
    return [
        "--hf-checkpoint",
        str(model),
        "--load-debug-rollout-data",
        template,
        "--loss-type",
        "sft_loss",
        "--num-rollout",
        str(args.sft_steps),
        "--rollout-batch-size",
        str(args.sft_batch),
        "--n-samples-per-prompt",
        "1",
        "--lr",
        str(args.sft_lr),
        "--lr-decay-style",
        "constant",
        # Evaluate every SFT_EVAL_INTERVAL steps and stop at the first mean reward (held-out and
        # dev) at --warmup-target: the warm-up teaches the format and hands GRPO a low start.
        "--eval-interval",
        str(SFT_EVAL_INTERVAL),
        "--update-weights-interval",
        str(SFT_EVAL_INTERVAL),
        "--stop-at-eval-reward",
        str(args.warmup_target),
        "--eval-prompt-data",
        "heldout",
        str(out / "eval.jsonl"),
        "dev",
        str(out / "dev.jsonl"),
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(out / "sft_weights"),
        "--run-dir",
        str(out / "sft_run"),
        "--save-hf",
        str(sft_model),
        *common_flags(args, out),
        # The trainer scales logits by the rollout temperature; the warm-up fits the plain distribution.
        "--rollout-temperature",
        "1.0",
    ]


def grpo_argv(args: argparse.Namespace, out: Path, start_model: Path) -> list[str]:
    return [
        "--hf-checkpoint",
        str(start_model),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.samples),
        "--rollout-shuffle",
        "--rollout-seed",
        str(args.seed),
        "--num-rollout",
        str(args.max_steps),
        "--eval-interval",
        str(args.eval_interval),
        "--stop-at-eval-reward",
        str(args.target),
        "--advantage-estimator",
        "grpo",
        "--lr",
        str(args.lr),
        "--lr-warmup-iters",
        str(args.lr_warmup),
        "--lr-decay-style",
        "constant",
        "--entropy-coef",
        str(args.entropy_coef),
        "--loop",
        args.loop,
        "--update-weight-transport",
        args.update_weight_transport,
        "--update-weight-mode",
        args.update_weight_mode,
        "--update-weight-disk-dir",
        str(out / "weights"),
        "--update-weight-local-checkpoint-dir",
        str(out / "local_weights"),
        "--run-dir",
        str(out / "grpo_run"),
        # Off-policy loops train on samples from older weights: with the engine's log-probs as the
        # old policy, PPO's clip bounds each update against the weights that sampled (without it
        # the async loop at temperature 0.5 blew up at step 10: entropy 0.8 -> 4.6, reward 0).
        *(["--use-rollout-logprobs"] if args.loop != "sync" else []),
        "--eval-prompt-data",
        "heldout",
        str(out / "eval.jsonl"),
        *common_flags(args, out),
    ]


def eval_curve(run_dir: Path, key: str = "eval/heldout/reward_mean") -> list[tuple[int, float]]:
    """(step, held-out reward) of every evaluation of a run; step -1 is before training."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [(int(r["step"]), float(r[key])) for r in live_metrics(read_jsonl(path)) if key in r]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} on {os.cpu_count()} cores"


def check(args: argparse.Namespace) -> None:
    """Refuse counts and rates the demo cannot run with, naming its flag, before anything is written."""
    least = {"max_steps": 1, "eval_interval": 1, "eval_prompts": 1, "sft_steps": 0, "sft_batch": 1}
    least |= {"prompts": 1, "samples": 2, "lr_warmup": 0}  # GRPO compares the samples of a group
    for key, low in least.items():
        if getattr(args, key) < low:
            raise ConfigError(f"--{key.replace('_', '-')}", getattr(args, key), f"must be at least {low}")
    for key in ("lr", "sft_lr", "temperature"):
        if not getattr(args, key) > 0:
            raise ConfigError(f"--{key.replace('_', '-')}", getattr(args, key), "must be > 0")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError("--out", str(args.out), "is not a directory; name a new or existing directory")


def main(args: argparse.Namespace) -> int:
    check(args)
    from tether.commands.plot import plot_run
    from tether.run.job import run_job
    from tether.run.process_threads import one_torch_thread
    from tether.runtime.loop import run

    one_torch_thread()  # this process is the runs' head

    started = time.monotonic()
    out: Path = args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] everything goes under {out}", flush=True)
    model = make_model(out, args.seed)
    train, held = demo_task.split(seed=123)
    demo_task.write_jsonl(out / "train.jsonl", train)
    demo_task.write_jsonl(out / "eval.jsonl", held[: args.eval_prompts])
    # Dev prompts come from the training prompts the warm-up never sees (it uses the first quarter).
    demo_task.write_jsonl(out / "dev.jsonl", random.Random(0).sample(train[len(train) // 4 :], DEV_PROMPTS))
    print(
        f"[demo] task: sort 4-5 digits; {len(train)} training prompts, {min(len(held), args.eval_prompts)} held out",
        flush=True,
    )

    start_model = model
    initial: float | None = None
    warmed: float | None = None
    if args.sft_steps > 0:
        template = write_sft_rollouts(out, model, train, args.sft_steps, args.sft_batch, args.seed)
        sft_model = out / "model_sft"
        argv = sft_argv(args, out, model, template, sft_model)
        print(
            f"[demo] supervised warm-up: up to {args.sft_steps} steps x {args.sft_batch} examples, "
            f"lr {args.sft_lr}, until the greedy reward reaches {args.warmup_target}",
            flush=True,
        )
        if run(run_job(resolve(argv), argv)) != 0:
            return 1
        curve = eval_curve(out / "sft_run")
        initial = next((v for s, v in curve if s < 0), None)
        warmed = curve[-1][1] if curve and curve[-1][0] >= 0 else None
        sft_steps = curve[-1][0] + 1 if curve else 0
        print(
            f"[demo] held-out reward: initial model {_fmt(initial)}, after {sft_steps} warm-up steps {_fmt(warmed)}",
            flush=True,
        )
        start_model = sft_model

    grpo_dir = out / "grpo_run"
    argv = grpo_argv(args, out, start_model)
    print(
        f"[demo] GRPO: {args.prompts} prompts x {args.samples} samples per step, lr {args.lr}, "
        f"temperature {args.temperature}, {args.loop} loop, {args.update_weight_mode} {args.update_weight_transport} "
        f"weight sync, {args.parallel}, target {args.target}",
        flush=True,
    )
    code = run(run_job(resolve(argv), argv))
    try:
        plots = [str(p) for p in plot_run(grpo_dir)]
    except SystemExit as e:  # no metrics: the run failed before its first step
        print(f"[demo] no plots: {e}", flush=True)
        plots = ["n/a"]
    evals = eval_curve(grpo_dir)
    before = next((v for s, v in evals if s < 0), None)
    if initial is None:
        initial = before
    start = before if before is not None else warmed
    last = evals[-1][1] if evals else None
    minutes = (time.monotonic() - started) / 60
    summary = {
        "seed": args.seed,
        "minutes": round(minutes, 2),
        "load": _load(),
        "heldout_reward_initial": initial,
        "heldout_reward_after_warmup": warmed,
        "heldout_reward_grpo_start": start,
        "heldout_reward_final": last,
        "heldout_reward_best": max((v for _, v in evals), default=None),
        "grpo_gain": round(last / start, 2) if last is not None and start else None,
        "target_reached": last is not None and last >= args.target,
        "grpo_steps": max((s for s, _ in evals), default=-1) + 1,
        "curve": [(s, round(v, 3)) for s, v in evals],
        "receipt": str(grpo_dir / "receipt.json"),
        "metrics": str(grpo_dir / "metrics.jsonl"),
        "reward_plot": plots[-1],
        "curves": plots[0],
    }
    write_bytes_atomic(out / "summary.json", json.dumps(summary, indent=2).encode())
    print(f"[demo] summary ({out / 'summary.json'}):", flush=True)
    print(
        f"[demo]   held-out reward: initial {_fmt(initial)}, after warm-up {_fmt(warmed)}, "
        f"final {_fmt(last)} after {summary['grpo_steps']} GRPO steps "
        f"(x{summary['grpo_gain']} over GRPO's start {_fmt(start)}; target {args.target} "
        f"{'reached' if summary['target_reached'] else 'NOT reached'})",
        flush=True,
    )
    print(f"[demo]   wall time {minutes:.1f} min ({_load()})", flush=True)
    print(f"[demo]   receipt     {summary['receipt']}", flush=True)
    print(f"[demo]   metrics     {summary['metrics']}", flush=True)
    print(f"[demo]   reward plot {summary['reward_plot']}  (all curves: {summary['curves']})", flush=True)
    return code


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"

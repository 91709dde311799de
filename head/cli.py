"""The `tether` command line: a table of subcommands, each imported only when used.

Start-up speed is part of the product, so `tether --help` imports nothing heavy: each
subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`,
or `main_argv(argv) -> int` when it parses the run configuration (with its pass-through flags).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "run": Command("tether.run_command", "Train with RL: start engines and trainer ranks and run the loop."),
    "demo": Command("tether.demo", "The CPU demo: a tiny model learns a toy task with GRPO."),
    "plan": Command(
        "tether.plan_command", "Print the placement plan for a set of run flags; starts nothing."
    ),
    "engine": Command(
        "tether.rollout.cpu_engine", "Serve a model with the embedded CPU engine (SGLang's HTTP API)."
    ),
    "init-model": Command(
        "tether.rollout.cpu_engine.tiny_model", "Write a small random Hugging Face model and tokenizer."
    ),
    "bench": Command("tether.bench", "Benchmarks that print JSON: runtime, engine, rollout, sync, e2e."),
    "weights": Command("tether.sync.cli", "Operator tools for published weights: diff, apply, verify."),
    "agent": Command("tether.runtime.agent", "Run a node agent that starts processes for a head."),
    "plot": Command("tether.plot", "Write PNG curves from a run directory's metrics."),
    "convert": Command(
        "tether.convert_command", "Convert checkpoints: hf-to-megatron, megatron-to-hf (as slime's tools)."
    ),
    "version": Command("tether.version", "Print the versions of tether and the engines it drives."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="RL post-training on Megatron-core and SGLang, supervised by asyncio instead of Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        build_parser().parse_args(args)  # prints help or the "invalid choice" error and exits
        return 2
    name, rest = args[0], args[1:]
    module = importlib.import_module(COMMANDS[name].module)
    if hasattr(module, "main_argv"):  # commands that take the run configuration parse it themselves
        return int(module.main_argv(rest) or 0)
    parser = argparse.ArgumentParser(prog=f"tether {name}", description=COMMANDS[name].help)
    module.add_arguments(parser)
    parsed = parser.parse_args(rest)
    return int(module.main(parsed) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

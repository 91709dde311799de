"""The `tether` command line: a table of subcommands, each imported only when used.

Start-up speed is part of the product, so `tether --help` imports nothing heavy: each
subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`,
or `main_argv(argv) -> int` when it parses the run configuration (with its pass-through flags).

A mistake in the user's input (`tether.runtime.errors.UserError`: a flag, a YAML key, a named
file) ends the command with one line, `tether <command>: <message>`, and exit status 2; any other
exception is a bug and keeps its traceback. `tether --debug` (or TETHER_DEBUG=1) shows the
traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

from tether.runtime.errors import DEBUG_ENV, USAGE_EXIT, exit_on_user_error


class Command(NamedTuple):
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "run": Command("tether.commands.run", "Train with RL: start engines and trainer ranks and run the loop."),
    "demo": Command("tether.commands.demo", "The CPU demo: a tiny model learns a toy task with GRPO."),
    "plan": Command(
        "tether.commands.plan", "Print the placement plan for a set of run flags; starts nothing."
    ),
    "engine": Command(
        "tether.rollout.cpu_engine", "Serve a model with the embedded CPU engine (SGLang's HTTP API)."
    ),
    "init-model": Command(
        "tether.rollout.cpu_engine.modeling.tiny_model",
        "Write a small random Hugging Face model and tokenizer.",
    ),
    "bench": Command("tether.bench", "Benchmarks that print JSON: runtime, engine, rollout, sync, e2e."),
    "weights": Command("tether.sync.cli", "Operator tools for published weights: diff, apply, verify."),
    "agent": Command("tether.runtime.process.agent", "Run a node agent that starts processes for a head."),
    "plot": Command("tether.commands.plot", "Write PNG curves from a run directory's metrics."),
    "status": Command(
        "tether.commands.status", "Print a run's nodes, engines, trainer ranks and step (live or ended)."
    ),
    "drain": Command(
        "tether.commands.drain", "Drain a node of a running run: its engines finish, leave and stop."
    ),
    "convert": Command(
        "tether.commands.convert", "Convert checkpoints: hf-to-megatron, megatron-to-hf (as slime's tools)."
    ),
    "version": Command("tether.commands.version", "Print the versions of tether and the engines it drives."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="RL post-training on Megatron-core and SGLang, supervised by asyncio instead of Ray.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"Show the traceback of errors in flags and files too (as {DEBUG_ENV}=1 does).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--debug"]:
        os.environ[DEBUG_ENV] = "1"  # the processes the command starts (engines, ranks) inherit it
        args = args[1:]
    if not args or args[0] not in COMMANDS:
        build_parser().parse_args(args)  # prints help or the "invalid choice" error and exits
        return USAGE_EXIT
    name, rest = args[0], args[1:]
    return exit_on_user_error(f"tether {name}", lambda: _run(name, rest))


def _run(name: str, rest: list[str]) -> int:
    module = importlib.import_module(COMMANDS[name].module)
    if hasattr(module, "main_argv"):  # commands that take the run configuration parse it themselves
        return int(module.main_argv(rest) or 0)
    parser = argparse.ArgumentParser(prog=f"tether {name}", description=COMMANDS[name].help)
    module.add_arguments(parser)
    parsed = parser.parse_args(rest)
    return int(module.main(parsed) or 0)


RUN_CONFIG_COMMANDS = ("run", "plan")
"""Commands whose argv is the run configuration (`plan` adds `--json`)."""


def parse_only(argv: Sequence[str]) -> object:
    """Parse a `tether` command line as `main` would, running nothing; returns what was parsed
    (None for a run configuration's `--help`). Bad input raises as there: SystemExit from argparse,
    ConfigError from the run configuration. tests/unit/test_docs.py checks the docs' commands so."""
    args = list(argv)
    if args[:1] == ["--debug"]:
        args = args[1:]
    if not args or args[0] not in COMMANDS:
        return build_parser().parse_args(args)
    name, rest = args[0], args[1:]
    if name in RUN_CONFIG_COMMANDS:
        if "-h" in rest or "--help" in rest:
            return None
        from tether.config import resolve

        return resolve([a for a in rest if not (name == "plan" and a == "--json")])
    module = importlib.import_module(COMMANDS[name].module)
    if name == "bench":
        return module.parse_bench_args(rest)
    if hasattr(module, "main_argv"):
        raise NotImplementedError(f"tether {name} parses in main_argv: teach parse_only its parser")
    parser = argparse.ArgumentParser(prog=f"tether {name}", description=COMMANDS[name].help)
    module.add_arguments(parser)
    return parser.parse_args(rest)


if __name__ == "__main__":
    raise SystemExit(main())

"""`tether run [flags]`: resolve the configuration, then run the job on uvloop."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from tether.config import Config, check_epoch_source, help_text, resolve
from tether.rollout.hooks.checks import check_hooks
from tether.run.train_data_hooks import check_train_data_hooks
from tether.runtime.errors import ConfigError
from tether.runtime.process.gc_tuning import imports_without_gc

DESCRIPTION = """Train with RL: start engines and trainer ranks, then run the sync, async or fully-async loop.
Flags use slime's names; Megatron flags go to Megatron; --sglang-<flag> goes to SGLang as --<flag>.
"""


def parse(argv: Sequence[str], prog: str = "tether run") -> Config:
    """The resolved Config, or exit 2 with the message naming the flag and the value."""
    try:
        return resolve(list(argv))
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main_argv(argv: Sequence[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print("usage: tether run [--config YAML] [flags]\n\n" + DESCRIPTION + "\n" + help_text())
        return 0
    # Resolving imports the config's modules and the hooks, then the job's modules: start-up
    # work, with the collector off (the job itself runs with it on).
    with imports_without_gc():
        cfg = _checked(argv)
        if isinstance(cfg, int):
            return cfg
        from tether.run.job import run_job
        from tether.runtime.loop import run
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(run_job(cfg, list(argv)))


def _checked(argv: Sequence[str]) -> Config | int:
    """The resolved and checked Config, or the exit status after saying what is wrong."""
    cfg = parse(argv)
    try:
        check_epoch_source(cfg)  # --num-epoch counts a --data-source-path class by its len()
    except ConfigError as exc:
        print(f"tether run: {exc}", file=sys.stderr)
        return 2
    if not cfg.debug.debug_train_only:
        try:
            check_hooks(cfg.rollout)  # before any process starts: every hook imports and fits its call
            check_train_data_hooks(cfg.algorithm)
        except ConfigError as exc:
            print(f"tether run: {exc}", file=sys.stderr)
            return 2
    return cfg

"""`tether plan [run flags] [--json]`: the placement plan a run would use; starts nothing."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tether.placement.render import print_plan
from tether.rollout.hooks.checks import check_hooks
from tether.run.train_data_hooks import check_train_data_hooks
from tether.runtime.errors import ConfigError


def main_argv(argv: Sequence[str]) -> int:
    args = list(argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if "-h" in args or "--help" in args:
        from tether.config import help_text

        print(
            "usage: tether plan [--json] [run flags]\n\nPrints the placement plan for the run flags; starts nothing.\n"
        )
        print(help_text())
        return 0
    from tether.commands.run import parse
    from tether.config import check_epoch_source, horizon_note
    from tether.run.job import make_plan

    cfg = parse(args, prog="tether plan")
    try:
        check_epoch_source(cfg)  # --num-epoch counts a --data-source-path class by its len()
        if not cfg.debug.debug_train_only:
            check_hooks(cfg.rollout)  # every hook imports and takes the call it will get
            check_train_data_hooks(cfg.algorithm)
    except ConfigError as exc:
        print(f"tether plan: {exc}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cfg)
    except ValueError as exc:  # impossible requests name the numbers
        print(f"tether plan: {exc}", file=sys.stderr)
        return 2
    if as_json:
        sys.stdout.write(plan.to_json().decode() + "\n")
    else:
        print_plan(plan)
        note = horizon_note(cfg)
        if note is not None:
            print(note)
    return 0

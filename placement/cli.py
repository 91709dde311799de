"""`tether plan`: print the placement plan for a set of run flags; starts nothing.

The run-flag parsing is two small functions (`add_run_flags`, `parse_run_flags`), so the full run
configuration can replace them without touching the rest.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec
import msgspec.inspect as mi
from tether.placement.config import ClusterConfig
from tether.placement.inventory import discover_inventory
from tether.placement.plan import plan_from_config
from tether.placement.render import print_plan
from tether.runtime.errors import ConfigError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar(kind: mi.Type) -> type | None:
    for candidate, py in ((mi.IntType, int), (mi.FloatType, float), (mi.StrType, str)):
        if isinstance(kind, candidate):
            return py
    return None


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `tether plan` reads: every ClusterConfig field plus the two debug modes."""
    info = mi.type_info(ClusterConfig)
    assert isinstance(info, mi.StructType)
    group = parser.add_argument_group("cluster")
    for field in info.fields:
        kind, help_text = field.type, ""
        if isinstance(kind, mi.Metadata):
            help_text = str((kind.extra_json_schema or {}).get("description", ""))
            kind = kind.type
        optional = isinstance(kind, mi.UnionType)
        if isinstance(kind, mi.UnionType):
            kind = next(t for t in kind.types if not isinstance(t, mi.NoneType))
        dest = field.name
        if isinstance(kind, mi.BoolType):
            action: Any = argparse.BooleanOptionalAction if optional else "store_true"
            group.add_argument(_flag(dest), dest=dest, action=action, default=None, help=help_text)
        elif isinstance(kind, mi.ListType):
            item = _scalar(kind.item_type) or str
            group.add_argument(_flag(dest), dest=dest, type=item, nargs="*", default=None, help=help_text)
        else:
            group.add_argument(
                _flag(dest), dest=dest, type=_scalar(kind) or str, default=None, help=help_text
            )
    debug = parser.add_argument_group("debug modes")
    debug.add_argument(
        "--debug-rollout-only", action="store_true", help="Generate rollouts without a trainer."
    )
    debug.add_argument("--debug-train-only", action="store_true", help="Train without engines.")


def parse_run_flags(args: argparse.Namespace) -> tuple[ClusterConfig, bool, bool]:
    """The cluster slice and the debug modes from parsed flags (unset flags keep their defaults)."""
    values = {
        field: getattr(args, field)
        for field in ClusterConfig.__struct_fields__
        if getattr(args, field, None) is not None
    }
    try:
        cluster = msgspec.convert(values, ClusterConfig)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, ConfigError):  # the slice's own check already names the flag
            raise exc.__cause__ from None
        # msgspec names the field as `$.field_name`; say it as the flag the user typed.
        message = str(exc)
        path = message.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in message else ""
        field = path.split("[")[0]
        raise ConfigError(_flag(field) if field else "cluster flags", values.get(field), message) from exc
    return cluster, bool(args.debug_rollout_only), bool(args.debug_train_only)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON instead of tables.")


def main(args: argparse.Namespace) -> int:
    try:
        cluster, debug_rollout_only, debug_train_only = parse_run_flags(args)
        inventory = discover_inventory(cluster)
        plan = plan_from_config(cluster, debug_rollout_only, debug_train_only, inventory)
    except ConfigError as exc:
        print(f"tether plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.format(plan.to_json(), indent=2).decode() + "\n")
    else:
        print_plan(plan)
    return 0

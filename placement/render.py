"""A placement plan as readable rich tables (what `tether plan` prints)."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from tether.placement.plan import Bundle, Plan


def _devices(kind: str, devices: list[int]) -> str:
    prefix = "cpu" if kind == "cpu" else "gpu"
    return f"{prefix} " + ",".join(str(d) for d in devices) if devices else "-"


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _dp_attention(ports: list[int]) -> str:
    """The ports kept for SGLang's attention data parallelism, after the dist-init address."""
    return f" (+{_span(ports[0], ports[-1])} for DP attention)" if ports else ""


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _bundles(plan: Plan, bundles: list[Bundle]) -> str:
    by_node: dict[int, list[int]] = {}
    for bundle in bundles:
        by_node.setdefault(bundle.node, []).append(bundle.device)
    return "; ".join(f"{plan.nodes[n].hostname}: {_devices(plan.device_kind, d)}" for n, d in by_node.items())


def plan_renderable(plan: Plan) -> RenderableType:
    """The plan as a group of tables: nodes, trainer launches, engines, reservations, weight sync."""
    header = Text(
        f"placement plan · mode {plan.mode} · {plan.device_kind} devices · "
        f"offload train={plan.offload_train} rollout={plan.offload_rollout}",
        style="bold",
    )
    nodes = _table("nodes (rank order)", ("#", "hostname", "address", "devices"))
    for node in plan.nodes:
        nodes.add_row(str(node.index), node.hostname, node.address, _devices(plan.device_kind, node.devices))

    train = _table(
        "trainer launches (torchrun)",
        ("group", "node", "node_rank/nnodes", "ranks", "devices", "rendezvous", "shares"),
    )
    for group in plan.train_groups:
        for launch in group.nodes:
            last = launch.first_rank + launch.nproc_per_node - 1
            train.add_row(
                group.role,
                launch.hostname,
                f"{launch.node_rank}/{launch.nnodes}",
                _span(launch.first_rank, last),
                _devices(plan.device_kind, launch.devices),
                launch.rdzv_endpoint,
                group.shares_devices_with or "",
            )

    engines = Table(title="rollout engines", title_justify="left")
    for column in (
        "#",
        "group",
        "type",
        "tp",
        "node(s)",
        "devices",
        "address",
        "nccl",
        "dist-init",
        "sync ranks",
    ):
        engines.add_column(column)
    for engine in plan.engines:
        where = "; ".join(
            f"{p.hostname} (rank {p.node_rank})" if engine.nnodes > 1 else p.hostname for p in engine.parts
        )
        devices = "; ".join(_devices(plan.device_kind, p.devices) for p in engine.parts)
        sync = (
            "-"
            if engine.weight_sync_rank_offset is None
            else _span(engine.weight_sync_rank_offset, engine.weight_sync_rank_offset + engine.tp_size - 1)
        )
        engines.add_row(
            str(engine.index),
            engine.group,
            engine.worker_type,
            str(engine.tp_size),
            "external" if engine.external else where,
            devices or "-",
            engine.address,
            str(engine.nccl_port) if engine.nccl_port is not None else "-",
            (engine.dist_init_addr or "-") + _dp_attention(engine.dp_attention_ports),
            sync,
        )
    parts: list[RenderableType] = [header, nodes, train, engines]
    if plan.reserved:
        reserved = _table("reserved by placeholders", ("group", "devices"))
        for reservation in plan.reserved:
            reserved.add_row(reservation.group, _bundles(plan, reservation.bundles))
        parts.append(reserved)
    if plan.weight_sync is not None:
        layout = plan.weight_sync
        parts.append(
            Text(
                f"weight-sync group: world size {layout.world_size}, trainer rank 0 is group rank 0, "
                f"master {layout.master_addr}:{layout.master_port}"
            )
        )
    else:
        parts.append(Text("weight-sync group: none (no trainer or no engines)"))
    return Group(*parts)


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the plan's tables to the console (stdout by default)."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            # Piped into a file or a receipt: keep whole rows instead of rich's 80-column default.
            console = Console(width=200)
    console.print(plan_renderable(plan))

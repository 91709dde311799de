"""A run's state for the operator (`tether status`): nodes, engines, trainer ranks, the step.

`from_records(run_dir)` reads it from the run's own files (receipt.json's plan, events.jsonl,
samples.jsonl), so it works for a run that ended, or whose head is gone; a live head answers
the same `RunStatus` on its control socket (tether.run.live_status), which is fresher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from tether.records.run_dir import model_steps
from tether.runtime.errors import UserError

Source = Literal["records", "live"]

COLUMNS: dict[str, dict[str, str]] = {
    "nodes": {
        "node": "the node's host name, as in the placement plan",
        "address": "its planned address",
        "state": "`up`, or `lost` while its agent does not answer heartbeats (why, in `reason`), or "
        "`drained`; a node that joined the running run says `(joined)`",
    },
    "engines": {
        "engine": "the engine's name (`engine0`, …), or an external engine's URL",
        "node": "the node it runs on",
        "state": "`serving`; `starting`; `restarting` while it is replaced; `lost` while its node is "
        "lost; `drained` once its node was",
        "version": "the weight version it serves (0: --hf-checkpoint); empty while not serving",
        "load": "requests in flight on it now (live view only)",
        "restarts": "times it was restarted after a failure of its own (a lost node does not count)",
    },
    "trainer": {
        "group": "the trainer job (`actor`, or `critic` with PPO)",
        "node": "the node its torchrun runs on",
        "ranks": "the global ranks there",
        "state": "`running`, or `exited` once its processes ended",
    },
}
"""The columns `tether status` prints, per table, with their meaning (docs/operations.md)."""


class NodeRow(msgspec.Struct, kw_only=True):
    node: str
    address: str
    state: str
    reason: str = ""
    joined: bool = False
    """It joined the running run (`tether agent --join`): not a node of the plan."""


class EngineRow(msgspec.Struct, kw_only=True):
    engine: str
    node: str
    state: str
    version: int | None
    load: int | None = None
    restarts: int = 0


class RankRow(msgspec.Struct, kw_only=True):
    group: str
    node: str
    ranks: str
    state: str
    process: str = ""
    """The supervisor's name of its torchrun launch (not printed)."""


class RunStatus(msgspec.Struct, kw_only=True):
    run_dir: str
    state: str
    """`starting`, `running`, `finished`, `failed` or `stopped`."""
    step: int | None
    """The last step trained into the model (None before the first)."""
    total: int | None
    version: int
    """The newest weight version published to the engines."""
    nodes: list[NodeRow]
    engines: list[EngineRow]
    trainer: list[RankRow]
    source: Source = "records"
    note: str = ""


_ENDS = {"finished": "finished", "failed": "failed", "stopped": "stopped"}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written as we read
    return rows


def read_plan(run_dir: Path) -> dict[str, Any]:
    """The placement plan in `run_dir`'s receipt; a UserError naming the path when there is none."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory; give the run directory of a `tether run`")
    receipt = run_dir / "receipt.json"
    try:
        plan: dict[str, Any] = json.loads(receipt.read_text())["plan"]
    except FileNotFoundError:
        raise UserError(f"{receipt}: no receipt; is {run_dir} the run directory of a `tether run`?") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{receipt}: not a tether receipt ({type(exc).__name__}: {exc})") from None
    return plan


def from_records(run_dir: Path) -> RunStatus:
    """The run's state as its records tell it (see the module docstring)."""
    plan = read_plan(run_dir)
    events = _jsonl(run_dir / "events.jsonl")
    hosts = {int(n["index"]): str(n["hostname"]) for n in plan.get("nodes", [])}
    nodes = {
        str(n["hostname"]): NodeRow(node=str(n["hostname"]), address=str(n["address"]), state="up")
        for n in plan.get("nodes", [])
    }
    engines: dict[str, EngineRow] = {}
    for engine in plan.get("engines", []):
        name = f"http://{engine['address']}" if engine["external"] else f"engine{engine['index']}"
        where = "external" if engine["external"] else ",".join(hosts[p["node"]] for p in engine["parts"])
        state = "serving" if engine["external"] else "starting"
        engines[name] = EngineRow(
            engine=name, node=where, state=state, version=0 if engine["external"] else None
        )
    state, version = "starting", 0
    exited: set[str] = set()
    for event in events:
        kind = event.get("event")
        row = engines.get(str(event.get("engine")))
        if kind == "ready":
            state = "running"
        elif kind in _ENDS:
            state = _ENDS[kind]
        elif kind == "node_lost" and event.get("node") in nodes:
            nodes[event["node"]].state, nodes[event["node"]].reason = "lost", str(event.get("reason", ""))
        elif kind == "node_joined" and event.get("joined"):
            name = str(event["node"])
            address = str(event.get("address", "")).removeprefix("tcp://").rsplit(":", 1)[0]
            nodes[name] = NodeRow(node=name, address=address, state="up", joined=True)
        elif kind == "node_joined" and event.get("node") in nodes:
            nodes[event["node"]].state, nodes[event["node"]].reason = "up", ""
        elif kind == "node_drained" and event.get("node") in nodes:
            nodes[event["node"]].state, nodes[event["node"]].reason = "drained", ""
        elif kind == "capacity_added":
            if event.get("node") in nodes and event.get("address"):
                nodes[event["node"]].address = str(event["address"])
            for name in event.get("engines", []):
                engines[name] = EngineRow(
                    engine=name,
                    node=str(event.get("node")),
                    state="serving",
                    version=int(event.get("version", 0)),
                )
        elif kind == "capacity_drained":
            for name in event.get("engines", []):
                if name in engines:
                    engines[name].state, engines[name].version = "drained", None
        elif kind == "weight_sync":
            version = int(event["version"])
            for each in engines.values():
                if each.state == "serving":
                    each.version = version
        elif kind == "process_exit":
            exited.add(str(event.get("name")))
        elif row is not None:
            if kind == "engine_ready":
                row.state, row.version = "serving", 0
            elif kind == "engine_failed":
                row.state, row.version = "restarting", None
            elif kind == "engine_lost":
                row.state, row.version = "lost", None
            elif kind in ("engine_restarted", "engine_rejoined"):
                row.state, row.version = "serving", int(event.get("version", 0))
                row.restarts += kind == "engine_restarted"
    ended = state in _ENDS.values()
    trainer = [
        RankRow(
            group=str(group["role"]),
            node=str(node["hostname"]),
            ranks=_ranks(int(node["first_rank"]), int(node["nproc_per_node"])),
            state="exited" if ended or _torchrun_name(group, node) in exited else "running",
            process=_torchrun_name(group, node),
        )
        for group in plan.get("train_groups", [])
        for node in group["nodes"]
    ]
    if ended:
        for each in engines.values():
            if each.state not in ("lost", "drained") and each.node != "external":
                each.state = "exited"
    steps = model_steps(_jsonl(run_dir / "samples.jsonl")).steps  # trained, and not discarded
    return RunStatus(
        run_dir=str(run_dir),
        state=state,
        step=max(steps) if steps else None,
        total=_total(run_dir),
        version=version,
        nodes=list(nodes.values()),
        engines=list(engines.values()),
        trainer=trainer,
    )


def _torchrun_name(group: dict[str, Any], node: dict[str, Any]) -> str:
    """The supervisor's name of one torchrun launch (tether.run.trainer_pool names them so)."""
    prefix = "trainer" if group["role"] == "actor" else str(group["role"])
    return f"{prefix}-node{node['node_rank']}"


def _ranks(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def _total(run_dir: Path) -> int | None:
    try:
        total = json.loads((run_dir / "receipt.json").read_text())["config"]["data"]["num_rollout"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    return int(total) if isinstance(total, int) else None

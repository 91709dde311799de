"""The head ↔ trainer-rank protocol: the one definition both sides import.

`RankApi` is the RPC surface of a trainer rank. The rank's `TrainerWorker` implements it (the
RPC server serves its public async methods), and the head's `RankClient` implements it too,
each method calling the remote method of the same name and decoding the reply as the declared
result type. Both subclass `RankApi`, so mypy checks either side against it: a renamed method,
argument or field fails the type check, not a run.

Each collective call takes one request Struct and returns one result Struct (`load`: or None
when there is no checkpoint); `health` and `shutdown` take nothing. The RPC server decodes a
Struct-annotated argument as that Struct (`tether.runtime.rpc.actors`), so a rank checks what it gets
before any work starts. Arrays (the `TrainBatch` columns of a shard, the log-probs that come
back) travel as raw frames at any depth of a Struct, unchanged by the wrapping.

Ordering contract (Megatron's collectives): the head calls every rank with the same method and
awaits all of them before the next collective call (`init`, `train`, `compute_log_probs`,
`compute_values`, `update_weights`, `save`, `load`, `export_hf`, and `offload`, which a
pending parameter all-gather may make one); ranks of one data-parallel group receive the same
request. `health` and `shutdown` are not collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from tether.runtime.rpc.actors import ActorHandle
from tether.sync.config import WeightSyncConfig
from tether.sync.ledger import LedgerEntry
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.profiling.config import ProfileConfig
from tether.train.rank.batching import TrainBatch

MicroBatchPlan = list[list[int]]
"""Sample indices of each micro-batch of a shard, in the order they run."""

TrainRole = Literal["actor", "critic"]
"""What a trainer job trains: the policy, or PPO's critic (advantage estimator ppo)."""

LogProbModel = Literal["actor", "ref", "teacher"]
"""Whose log-probs: the actor's before the step ("old"), the frozen reference model's, or the
on-policy distillation teacher's (--opd-type megatron)."""


class WorkerInfo(msgspec.Struct, kw_only=True):
    """What `init` and `health` report about a rank."""

    rank: int
    world_size: int
    initialized: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    is_sync_source: bool = False
    steps: int = 0
    busy: bool = False


class InitRequest(msgspec.Struct, kw_only=True):
    """Join the job's process groups and build the actor (and the reference model for KL)."""

    hf_checkpoint: str
    algorithm: AlgorithmConfig
    megatron: MegatronConfig
    temperature: float = 1.0
    with_reference: bool = False  # build the reference even when the algorithm needs none
    offload_train: bool = False  # --offload-train: device memory to host after each weight update
    role: TrainRole = "actor"  # "critic": the PPO critic (value head, value loss; no reference)
    # The profiling slice, and where its traces (and, by default, memory snapshots) go.
    profile: ProfileConfig = msgspec.field(default_factory=ProfileConfig)
    profile_dir: str = ""


class TrainRequest(msgspec.Struct, kw_only=True):
    """One optimizer step on a rank's data-parallel shard."""

    rollout_id: int
    shard: TrainBatch
    plan: MicroBatchPlan
    # The rollout's first and last optimizer step: --reset-optimizer-states clears the optimizer
    # before the first, --ref-update-interval may update the reference after the last.
    first_of_rollout: bool = True
    last_of_rollout: bool = True
    step_id: int = 0  # the step's index in its rollout (slime's step_id, given to the train-step hook)


class TrainResult(msgspec.Struct, kw_only=True):
    """The step's metrics (losses, grad norm, lr, ...), the same on every rank."""

    metrics: dict[str, float]


class LogProbsRequest(msgspec.Struct, kw_only=True):
    """Per-response-token log-probs of `model` over a rank's shard."""

    shard: TrainBatch
    plan: MicroBatchPlan
    model: LogProbModel = "actor"
    with_entropy: bool = False


class LogProbsResult(msgspec.Struct, kw_only=True):
    """float32 [sum(response_lengths)] each; `entropy` only when asked for."""

    log_probs: np.ndarray
    entropy: np.ndarray | None = None


class ValuesRequest(msgspec.Struct, kw_only=True):
    """The critic's value of every response token of a rank's shard (role "critic" only)."""

    shard: TrainBatch
    plan: MicroBatchPlan


class ValuesResult(msgspec.Struct, kw_only=True):
    """float32 [sum(response_lengths)], in shard order."""

    values: np.ndarray


class UpdateWeightsRequest(msgspec.Struct, kw_only=True):
    """Publish the actor's weights as `version` to every engine (collective over all ranks)."""

    version: int
    engine_urls: list[str]
    weight_sync: WeightSyncConfig
    colocate: bool = False
    engine_ranks: list[int] | None = None  # GPUs of each engine in the update group (plan's layout)
    master_address: str = "127.0.0.1"
    master_port: int = 0
    engines_restarted: bool = False  # an engine was replaced: rebuild the update group first
    # colocate: per engine, the global rank on each of its TP ranks' devices, whose own copy of
    # the weights that engine rank opens (tether.placement.colocation.handle_sources)
    handle_sources: list[list[int]] | None = None


class WeightUpdateResult(msgspec.Struct, kw_only=True):
    """The sync's ledger entry, from the rank that drives the engines; None on the others."""

    entry: LedgerEntry | None = None


class SaveRequest(msgspec.Struct, kw_only=True):
    """Write checkpoint iter_{step} under save_dir, with the run state a resume needs."""

    save_dir: str
    step: int
    rollout_id: int
    weight_version: int = 0
    data_position: dict[str, Any] = msgspec.field(default_factory=dict)
    # --async-save: answer only once the checkpoint is complete (the run's last save, a signal's)
    finalize: bool = False


class SaveResult(msgspec.Struct, kw_only=True):
    path: str


class LoadRequest(msgspec.Struct, kw_only=True):
    """Resume from the newest loadable complete checkpoint in load_dir (any Megatron layout).

    `finetune`: its weights only, the run starts at step 0 (the state says rollout_id -1).
    `hf`: load_dir is a Hugging Face model directory: its weights only (implies finetune).
    `ckpt_step`: load iter_N of load_dir, not the tracker's (`ckpt_step_flag` names the flag
    that asked: --ckpt-step or --ref-ckpt-step).
    """

    load_dir: str
    finetune: bool = False
    hf: bool = False
    ckpt_step: int | None = None
    ckpt_step_flag: str = "--ckpt-step"


class DamagedCheckpoint(msgspec.Struct, frozen=True):
    """A complete checkpoint that could not be loaded, and why (a load fell back past it)."""

    path: str
    error: str


class LoadedState(msgspec.Struct, kw_only=True):
    """The run state of the checkpoint a load restored, where it was, and what it skipped."""

    step: int
    rollout_id: int
    weight_version: int
    data_position: dict[str, Any]
    path: str
    skipped: list[DamagedCheckpoint] = msgspec.field(default_factory=list)  # newest first


class ExportRequest(msgspec.Struct, kw_only=True):
    """Write the actor as an HF checkpoint directory."""

    out_dir: str
    version: int = 0


class ExportResult(msgspec.Struct, kw_only=True):
    path: str | None = None  # where rank 0 wrote it; None on the other ranks


class CompareHFRequest(msgspec.Struct, kw_only=True):
    """Compare the actor's weights with those of the HF checkpoint in `hf_dir`, tensor by tensor
    (`tether.train.checkpoint.hf_match`)."""

    hf_dir: str


class CompareHFResult(msgspec.Struct, kw_only=True):
    compared: int  # tensors this rank compared (none on a rank that only joins the TP gathers)
    difference: str | None = None  # the first tensor that differs, and how; None: all equal


class RankApi(Protocol):
    """The RPC surface of a trainer rank: `TrainerWorker` serves it, `RankClient` calls it.

    Both subclass it explicitly, so mypy checks every override's signature against these and
    refuses to instantiate a side that lacks one. A served implementation must annotate each
    `request` with its Struct as here: the RPC server decodes by the served method's annotations.
    """

    async def init(self, request: InitRequest) -> WorkerInfo: ...

    async def train(self, request: TrainRequest) -> TrainResult: ...

    async def compute_log_probs(self, request: LogProbsRequest) -> LogProbsResult: ...

    async def compute_values(self, request: ValuesRequest) -> ValuesResult: ...

    async def update_weights(self, request: UpdateWeightsRequest) -> WeightUpdateResult: ...

    async def save(self, request: SaveRequest) -> SaveResult: ...

    async def load(self, request: LoadRequest) -> LoadedState | None:
        """None when load_dir holds no loadable checkpoint."""
        ...

    async def export_hf(self, request: ExportRequest) -> ExportResult: ...

    async def compare_hf(self, request: CompareHFRequest) -> CompareHFResult: ...

    async def offload(self) -> None:
        """--offload-train: move the trainer's device memory to host now (before colocated engines
        take theirs back); the next call that needs it brings it back. Nothing without the flag."""
        ...

    async def health(self) -> WorkerInfo:
        """Answered from the rank's event loop, even while a step runs."""
        ...

    async def shutdown(self) -> None:
        """Stop serving; the rank then leaves its process groups and exits 0."""
        ...


def _name(method: Callable[..., Any]) -> str:
    """The RPC name of a `RankApi` method: its own name, so the two cannot drift apart."""
    return method.__name__


class RankClient(RankApi):
    """The head's typed handle on one trainer rank: `await rank.train(TrainRequest(...))`."""

    def __init__(self, handle: ActorHandle, timeout: float | None = None) -> None:
        """`timeout`: the limit of every call (a rank that hangs must not hang the head forever)."""
        self.handle = handle
        self.timeout = timeout

    @property
    def name(self) -> str:
        return self.handle.name

    async def _call(
        self,
        method: Callable[..., Any],
        result_type: Any,
        *args: Any,
        timeout: float | None = None,  # noqa: ASYNC109  # the API takes per-call timeouts
    ) -> Any:
        """`method` on the rank, its reply decoded (and checked) as `result_type`; the caller's
        annotation states the same type for mypy."""
        limit = self.timeout if timeout is None else timeout
        return await self.handle.call(_name(method), *args, timeout=limit, result_type=result_type)

    async def init(self, request: InitRequest) -> WorkerInfo:
        return await self._call(RankApi.init, WorkerInfo, request)

    async def train(self, request: TrainRequest) -> TrainResult:
        return await self._call(RankApi.train, TrainResult, request)

    async def compute_log_probs(self, request: LogProbsRequest) -> LogProbsResult:
        return await self._call(RankApi.compute_log_probs, LogProbsResult, request)

    async def compute_values(self, request: ValuesRequest) -> ValuesResult:
        return await self._call(RankApi.compute_values, ValuesResult, request)

    async def update_weights(self, request: UpdateWeightsRequest) -> WeightUpdateResult:
        return await self._call(RankApi.update_weights, WeightUpdateResult, request)

    async def save(self, request: SaveRequest) -> SaveResult:
        return await self._call(RankApi.save, SaveResult, request)

    async def load(self, request: LoadRequest) -> LoadedState | None:
        result: LoadedState | None = await self._call(RankApi.load, LoadedState | None, request)
        return result

    async def export_hf(self, request: ExportRequest) -> ExportResult:
        return await self._call(RankApi.export_hf, ExportResult, request)

    async def compare_hf(self, request: CompareHFRequest) -> CompareHFResult:
        return await self._call(RankApi.compare_hf, CompareHFResult, request)

    async def offload(self) -> None:
        await self._call(RankApi.offload, None)

    async def health(self, *, timeout: float | None = None) -> WorkerInfo:  # noqa: ASYNC109
        return await self._call(RankApi.health, WorkerInfo, timeout=timeout)

    async def shutdown(self, *, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._call(RankApi.shutdown, None, timeout=timeout)

    async def close(self) -> None:
        """Close the connection (not a remote call)."""
        await self.handle.close()


__all__ = [
    "DamagedCheckpoint",
    "ExportRequest",
    "ExportResult",
    "InitRequest",
    "LoadRequest",
    "LoadedState",
    "LogProbModel",
    "LogProbsRequest",
    "LogProbsResult",
    "MicroBatchPlan",
    "RankApi",
    "RankClient",
    "SaveRequest",
    "SaveResult",
    "TrainRequest",
    "TrainResult",
    "TrainRole",
    "UpdateWeightsRequest",
    "ValuesRequest",
    "ValuesResult",
    "WeightUpdateResult",
    "WorkerInfo",
]

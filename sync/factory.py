"""The transport a run's flags choose, built on the sync source (trainer rank 0)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from tether.rollout.engine_api.auth import key_from_env
from tether.rollout.engine_api.client import EngineClient
from tether.sync.config import WeightSyncConfig
from tether.sync.ledger import LedgerEntry
from tether.sync.transports.delta import DeltaDiskTransport
from tether.sync.transports.disk import FullDiskTransport
from tether.sync.transports.distributed import DistributedTransport
from tether.sync.transports.tensor import TensorTransport


class Transport(Protocol):
    name: str

    async def sync(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> LedgerEntry: ...


def engine_clients(urls: Sequence[str], timeout: float, api_key: str | None = None) -> list[EngineClient]:
    """Clients for the engines a trainer rank pushes weights to, sending the engine key: `api_key`,
    else TETHER_ENGINE_API_KEY, which the head puts in the ranks' environment."""
    # The one HTTP client tether has for engines; sync depends on it rather than keeping a twin.
    key = api_key if api_key is not None else key_from_env()
    return [
        EngineClient(url, name=f"engine{i}", request_timeout=timeout, api_key=key)
        for i, url in enumerate(urls)
    ]


def weight_group_backend() -> str:
    """NCCL where the trainer has GPUs, gloo on CPU: one code path for both."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def sync_device(local_rank: int) -> torch.device | None:
    """A sync source rank's own GPU where the trainer has GPUs (a rank uses the GPU of its
    LOCAL_RANK), else None. Named explicitly: a rank chose its GPU on its worker thread only,
    and any other thread's current GPU is 0."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else None


def is_distributed(cfg: WeightSyncConfig, colocate: bool) -> bool:
    """Whether the flags choose the distributed (NCCL/gloo broadcast) transport."""
    return not colocate and cfg.update_weight_mode != "delta" and cfg.update_weight_transport != "disk"


def make_transport(
    cfg: WeightSyncConfig,
    engines: Sequence[EngineClient],
    *,
    hf_checkpoint: str,
    colocate: bool,
    engine_ranks: Sequence[int],
    master_address: str,
    master_port: int,
    device: torch.device | None = None,
) -> Transport:
    """The transport for --update-weight-mode / --update-weight-transport / --colocate.

    device: the sync source rank's own GPU, which an NCCL broadcast needs (see sync_device)."""
    if colocate:
        return TensorTransport(engines, cfg, engine_ranks=engine_ranks)
    if cfg.update_weight_mode == "delta":
        return DeltaDiskTransport(engines, cfg, hf_checkpoint=Path(hf_checkpoint))
    if not is_distributed(cfg, colocate):
        return FullDiskTransport(engines, cfg, base_dir=Path(hf_checkpoint))
    return DistributedTransport(
        engines,
        cfg,
        master_address=master_address,
        master_port=master_port,
        engine_ranks=engine_ranks,
        backend=weight_group_backend(),
        device=device,
    )

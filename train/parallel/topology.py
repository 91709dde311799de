"""Process groups for one trainer rank: torch.distributed from torchrun's environment, then
Megatron's parallel state (TP, PP, CP, DP, and the MoE expert groups), then seeds.

gloo on CPU, NCCL on GPU. On CPU the Megatron compatibility patches are applied here, after the
default group exists and before any model is built. Every group here connects over the interface
that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name: the node agent sets them to the one holding the
node's planned address (runtime/netif.py), so a job spanning nodes does not advertise 127.0.0.1.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tether.runtime.errors import ConfigError
from tether.train.model import megatron_cpu
from tether.train.parallel import context


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the job's parallel layout."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sync_source(self) -> bool:
        """TP, CP and DP rank 0 of its stage: the rank that exports this stage's weights."""
        return self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(name, None, "not set; start trainer ranks with torchrun")
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(name, value, "must be an integer") from e


def device() -> torch.device:
    """This rank's compute device: its local GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives and sends must live (NCCL: this GPU)."""
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def all_true(ok: bool) -> bool:
    """True on every rank when `ok` is true on every rank (a MIN all-reduce over the world; the
    flag lives on the device the default group's backend needs)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def init_distributed(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 30,
    deterministic: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    context_parallel: int = 1,
    contiguous_context: bool = False,
    experimental: bool = False,
) -> Topology:
    """Join the torchrun job and build Megatron's TP/PP/CP/DP (and MoE expert) groups; idempotent per
    process. `contiguous_context` (--allgather-cp): each CP rank holds a contiguous share of the
    sequence (`tether.train.parallel.context`). `experimental` (--enable-experimental): Megatron's
    experimental-features flag."""
    from megatron.core import parallel_state

    world_size = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK")
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ConfigError(
            "--tensor-model-parallel-size", tensor_parallel, f"must divide world size {world_size}"
        )
    if pipeline_parallel < 1 or world_size % (tensor_parallel * pipeline_parallel):
        raise ConfigError(
            "--pipeline-model-parallel-size",
            pipeline_parallel,
            f"TP*PP must divide world size {world_size} (TP={tensor_parallel})",
        )
    if context_parallel < 1 or world_size % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ConfigError(
            "--context-parallel-size",
            context_parallel,
            f"TP*PP*CP must divide world size {world_size} (TP={tensor_parallel}, PP={pipeline_parallel})",
        )
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    megatron_cpu.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            context_parallel_size=context_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
            distributed_timeout_minutes=timeout_minutes,
        )
    context.set_contiguous(contiguous_context)
    from megatron.core import config as megatron_config

    megatron_config.set_experimental_flag(experimental)
    set_seed(seed)
    if deterministic:
        use_deterministic_algorithms()
    return topology()


def use_deterministic_algorithms() -> None:
    """--deterministic-mode on this rank: torch's deterministic kernels only, cuDNN without autotuning
    (cuBLAS needs a fixed workspace for that, TransformerEngine's attention its deterministic
    algorithms; each is set unless the environment chose otherwise)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=False)


def topology() -> Topology:
    """The current rank's place, read from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
    )


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker.

    Megatron offsets the tracker's seed by TP rank itself; PP stages get distinct seeds so
    their layers do not start identical (as Megatron-LM does).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy() -> None:
    """Leave Megatron's groups and the default group (end of a worker or a check script)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

"""Megatron → Hugging Face weights: full tensors under HF names, gathered from TP shards.

Each PP stage exports its own layers under their global layer numbers. Every rank of a TP
group must iterate `iter_hf_weights` to the end (the TP gathers are collectives); all of them
receive the full tensors, and the stage's sync source (`Topology.is_sync_source`: TP rank 0,
DP rank 0) is the one that sends them on. `save_hf` streams every stage's tensors to global
rank 0, which writes one atomic HF directory with `tether.sync.hf_writer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tether.train.model import bridge
from tether.train.model.build import sync_params
from tether.train.model.hf_config import ModelArch
from tether.train.model.hf_convert import HFWeights, in_base_form
from tether.train.parallel.topology import Topology, collective_device

_END = "__tether_end_of_stage__"
CPU = torch.device("cpu")


def iter_hf_weights(
    chunks: list[Any],
    arch: ModelArch,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = CPU,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for every weight of this stage; collective over the TP group (and the
    expert-parallel groups of MoE experts).

    `device`: where the tensors are yielded (host memory by default, for files and gloo; None
    leaves them where they were gathered, so an NCCL broadcast or a CUDA IPC handle needs no
    round trip through the host).

    Every HF tensor of the stage comes out (MoE: each expert, the router gate and its
    e_score_correction_bias, shared experts; MLA's projections and norms), converted by mbridge
    (`tether.train.model.bridge`). With tied embeddings `lm_head.weight` is not emitted (HF reties it);
    the last stage's copy of the embedding is skipped when the first stage exports the original.
    """
    del arch  # each chunk carries its weight bridge (which holds the architecture)
    layout = bridge.Layout.current()
    sync_params(chunks)
    for chunk in chunks:
        for hf_name, full in bridge.weights_of(chunk).export(chunk, layout):
            out = full.detach() if device is None else full.detach().to(device)
            yield hf_name, out.to(dtype) if dtype is not None else out


def iter_every_stage(
    chunks: list[Any], arch: ModelArch, *, device: torch.device | None = CPU
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of every stage's weights, on every rank, in stage order: each stage
    exports its own (`iter_hf_weights`) and broadcasts them over its pipeline group, one tensor at a
    time (a pickled header, then the tensor itself). Collective over the whole job. The colocated
    sync needs it under PP > 1: each rank hands the engine ranks on its own device the whole model,
    as slime gathers every stage to each rank before its CUDA IPC update.

    `device`: as in `iter_hf_weights`; None keeps received tensors on the collective device."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    sources = dist.get_process_group_ranks(group)
    here = ps.get_pipeline_model_parallel_rank()
    wire = collective_device()
    own = iter_hf_weights(chunks, arch, device=wire)
    for stage, src in enumerate(sources):
        while True:
            item = next(own, None) if stage == here else None
            header: list[Any] = [None if item is None else (item[0], item[1].dtype, list(item[1].shape))]
            dist.broadcast_object_list(header, src=src, group=group)
            if header[0] is None:
                break  # this stage has sent all its tensors
            name, dtype, shape = header[0]
            tensor = (
                item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype, device=wire)
            )
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor if device is None else tensor.to(device)


def stream_to_rank0(
    chunks: list[Any],
    arch: ModelArch,
    topo: Topology,
    dtype: torch.dtype | None,
    device: torch.device | None = CPU,
) -> Iterator[tuple[str, torch.Tensor]]:
    """On global rank 0: this stage's tensors, then every later stage's, received in stage order
    (on `device`, as in `iter_hf_weights`).

    On every other rank: iterates its own stage (for the TP gathers) and, if it is a stage's
    sync source, sends each tensor to rank 0; yields nothing. Each tensor travels as a small
    pickled header (name, dtype, shape) and then its own send, never pickled.
    """
    from megatron.core import parallel_state as ps

    if topo.rank == 0:
        yield from iter_hf_weights(chunks, arch, dtype=dtype, device=device)
        recv_on = collective_device()
        for stage in range(1, topo.pp_size):
            src = _stage_source_rank(ps, stage)
            while True:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src)
                name, tensor_dtype, shape = box[0]
                if name == _END:
                    break
                buf = torch.empty(shape, dtype=tensor_dtype, device=recv_on)
                dist.recv(buf, src=src)
                yield name, buf if device is None else buf.to(device)
        return
    send = topo.is_sync_source and topo.pp_rank > 0
    # A rank that only takes part in the gathers leaves its copies where they are.
    wire = collective_device() if send else None
    for name, tensor in iter_hf_weights(chunks, arch, dtype=dtype, device=wire):
        if send:
            dist.send_object_list([(name, tensor.dtype, list(tensor.shape))], dst=0)
            dist.send(tensor.contiguous(), dst=0)
    if send:
        dist.send_object_list([(_END, None, None)], dst=0)


def _stage_source_rank(ps: Any, stage: int) -> int:
    """Global rank of the sync source of pipeline stage `stage`, as seen from global rank 0.

    Rank 0 is TP 0 / DP 0, so its pipeline group links the sync sources of all stages.
    """
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    return int(ranks[stage])


def save_hf(
    chunks: list[Any],
    arch: ModelArch,
    topo: Topology,
    out_dir: str | Path,
    *,
    base_dir: str | Path,
    version: int = 0,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write the whole model as an HF checkpoint at `out_dir` (atomic); collective over all ranks.

    Rank 0 writes; config and tokenizer files are copied from `base_dir` (the --hf-checkpoint).
    Returns the directory on rank 0, None elsewhere.
    """
    from tether.sync.hf_writer import write_hf_checkpoint

    stream = stream_to_rank0(chunks, arch, topo, dtype)
    out: Path | None = None
    if topo.rank == 0:
        if arch.is_moe or arch.hf_kept_prefixes:
            # Fused experts and the tensors the trainer does not hold, as the base checkpoint has them.
            base = HFWeights(base_dir)
            stream = in_base_form(stream, base, arch.num_experts, arch.hf_kept_prefixes)
        write_hf_checkpoint(stream, Path(out_dir), version=version, base_dir=Path(base_dir))
        out = Path(out_dir)
    else:
        for _ in stream:
            pass
    dist.barrier()
    return out

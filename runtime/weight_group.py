"""A standalone process group for trainer → engine weight broadcasts.

The trainer's source rank (rank 0) and every engine rank (rank_offset + tp rank) meet at a TCP
rendezvous (`tcp://host:port`) and build a gloo (CPU) or nccl (GPU) group named `group_name`,
the same kind of group SGLang's `init_weights_update_group` builds, so a tether trainer can
broadcast to real SGLang servers and to tether's CPU engine alike. torch's default process
group is neither needed nor touched: the process may already belong to another job's groups.

Rank 0's store listens on the rendezvous host's address alone. Each rank's gloo device takes
its address from GLOO_SOCKET_IFNAME, which the node agent sets to the interface holding the
node's planned address (runtime/netif.py); without it gloo would advertise the address the
hostname resolves to, often 127.0.0.1, and a group spanning nodes could not connect.

An NCCL group belongs to one GPU of its process: `device` names it, and every step that may
touch CUDA (the group's making, its collectives, its abort) runs with that GPU current, never
with whichever GPU the calling thread happens to have current (0 on a thread that never chose).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tether.runtime.errors import ConfigError
from tether.runtime.netif import bound_listener

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass
class WeightGroup:
    """A built group and the facts needed to use and tear it down."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    _process_group: dist.ProcessGroup | None
    device: torch.device | None = None
    """This rank's GPU for an NCCL group (None: gloo, or a caller that left torch to choose)."""

    @property
    def group(self) -> dist.ProcessGroup:
        if self._process_group is None:
            raise RuntimeError(f"weight group {self.group_name!r} was destroyed")
        return self._process_group

    @property
    def alive(self) -> bool:
        """Not yet destroyed or aborted here."""
        return self._process_group is not None


@contextmanager
def gpu_current(device: torch.device | None) -> Iterator[None]:
    """Run the body with `device` as this thread's current GPU (a CPU device or None: as is).
    CUDA's current device is per thread: a worker thread starts on GPU 0 whatever the rank's
    main thread chose."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def check_device(backend: str, device: torch.device | None) -> None:
    """An NCCL group's device must be one GPU by index; a gloo group's lives in host memory."""
    if device is None:
        return
    if backend == "nccl" and (device.type != "cuda" or device.index is None):
        raise ConfigError("device", str(device), "an NCCL weight group needs one GPU by index (cuda:N)")
    if backend == "gloo" and device.type != "cpu":
        raise ConfigError("device", str(device), "a gloo weight group moves host memory (cpu)")


def _check(init_method: str, rank: int, world_size: int, group_name: str, backend: str) -> None:
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ConfigError("init_method", init_method, "must look like tcp://host:port")
    if world_size < 1:
        raise ConfigError("world_size", world_size, "must be at least 1")
    if not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"must be in [0, {world_size})")
    if not group_name:
        raise ConfigError("group_name", group_name, "must not be empty")
    if backend not in ("gloo", "nccl"):
        raise ConfigError("backend", backend, "must be gloo or nccl")


def server_store(
    host: str, port: int, world_size: int | None, timeout: timedelta, *, wait_for_workers: bool = True
) -> dist.TCPStore:
    """A multi-tenant TCP store server listening on `host`'s address alone (port 0: a free port,
    see `.port`), not on every interface; where that address cannot be bound here, as torch
    listens by default."""
    listener = bound_listener(host, port)
    if listener is None:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            wait_for_workers=wait_for_workers,
        )
    # The store owns the descriptor from here on (it closes it when the server goes).
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        multi_tenant=True,
        wait_for_workers=wait_for_workers,
        master_listen_fd=listener.detach(),
    )


def host_store(host: str, port: int, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening now on `host` (port 0: a free port, see `.port`),
    without waiting for the other ranks; pass it to `init_weight_group` once they have been told."""
    return server_store(host, port, world_size, timeout, wait_for_workers=False)


def init_weight_group(
    init_method: str,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout: timedelta = DEFAULT_TIMEOUT,
    store: dist.TCPStore | None = None,
    setup_timeout: timedelta | None = None,
    device: torch.device | None = None,
) -> WeightGroup:
    """Join (rank 0: host) the rendezvous at `init_method` and build the named group.

    Blocks until all `world_size` ranks have joined or `timeout` passes. Call it from a worker
    thread in async code. Rank 0 hosts the TCP store, so it must be the trainer side; it may
    pass a store made by `host_store` (whose port `init_method` then names). `setup_timeout`
    (default `timeout`) bounds a joining rank's wait for the store and the rendezvous alone: an
    address that never answers fails within it, while `timeout` stays the collectives' limit.
    `device`: this rank's GPU for an NCCL group, current while the group is made and recorded
    on it (the communicator itself comes with the first collective, on that collective's
    tensors' GPU: an eager one would wait here for peers that join only at their first receive).
    """
    _check(init_method, rank, world_size, group_name, backend)
    check_device(backend, device)
    parsed = urlparse(init_method)
    assert parsed.hostname is not None and parsed.port is not None  # _check made sure
    if store is None:
        # An explicit store, not c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True)
        # rendezvous makes every rank a client of an agent store, so nobody would host this one.
        if rank == 0:
            store = server_store(parsed.hostname, parsed.port, world_size, timeout)
        else:
            store = dist.TCPStore(
                parsed.hostname, parsed.port, world_size, is_master=False, timeout=setup_timeout or timeout
            )
    # The prefix keeps two groups on one store (or one master port reused later) apart.
    prefixed = dist.PrefixStore(group_name, store)
    with gpu_current(device):
        group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            backend,
            prefixed,
            group_name=c10d.GroupName(group_name),
            timeout=timeout,
        )
    # With no default group, torch cannot map group ranks to global ranks by itself; in this
    # group they are the same numbers.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return WeightGroup(
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        backend=backend,
        _process_group=group,
        device=device,
    )


def broadcast(tensor: torch.Tensor, src: int, group: WeightGroup) -> None:
    """Broadcast `tensor` in place from rank `src` to every rank of `group` (blocking)."""
    if not 0 <= src < group.world_size:
        raise ConfigError("src", src, f"must be in [0, {group.world_size})")
    dist.broadcast(tensor, src=src, group=group.group)


def destroy_weight_group(group: WeightGroup) -> None:
    """Tear the group down (nothing left to do after `abort_weight_group`); its name may not be
    reused in this process afterwards."""
    _end(group, dist.destroy_process_group)


def abort_weight_group(group: WeightGroup) -> None:
    """End the group at once, collectives still pending included, and forget it here.

    NCCL: the communicator is aborted, so a broadcast some peer will never join stops holding
    this GPU's streams (and everything queued behind them) until the group's timeout, after
    which NCCL's watchdog would end the process. gloo cannot interrupt a pending operation: a
    thread inside one returns at the group's timeout, or once a peer drops its side; the group
    is forgotten all the same. A communicator NCCL is still setting up (at the group's first
    collective) has nothing to abort yet.
    Idempotent; the peers are not told (each tears its side down on its own).
    """
    _end(group, c10d._abort_process_group)


def _end(group: WeightGroup, end: Callable[[Any], None]) -> None:
    """Forget the group here and `end` its process group on its GPU (once)."""
    process_group, group._process_group = group._process_group, None
    if process_group is None:
        return
    with gpu_current(group.device):
        end(process_group)
    # Drop the last reference now: a gloo group whose C++ object lives on until interpreter
    # teardown can abort the process at exit ("terminate called without an active exception").
    del process_group
    gc.collect()

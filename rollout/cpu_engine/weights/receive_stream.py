"""Receiving a streamed distributed update (tether.runtime.bucket_stream): every bucket of one
sync in one call on one thread, each bucket's header read from the group right after the
previous bucket's bytes, so no HTTP round trip or thread hand-off sits between two buckets.

Each bucket is received and loaded as a per-request bucket is (BucketReceiver.receive), but its
tensors always arrive one by one: the sender packs nothing, and a flattened bucket is assembled
in its one buffer here. A
bucket that does not fit, or holds NaN or inf, is refused; the buckets after it are still
drained (the sender's collectives must complete and the group stay usable) but not loaded,
and the first refusal is raised once the stream has ended.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tether.rollout.cpu_engine.modeling.model import TinyLM, WeightMismatch
from tether.rollout.cpu_engine.weights.receive import BucketReceiver, wire_device
from tether.runtime.bucket_stream import StreamAborted, recv_header
from tether.runtime.weight_group import WeightGroup


def receive_stream(
    receiver: BucketReceiver,
    model: TinyLM,
    group: WeightGroup,
    flattened: bool,
    dtype_of: Callable[[str], torch.dtype],
    check_values: bool = True,
) -> int:
    """Receive and load buckets until the sender closes the stream; the number of buckets.
    WeightMismatch (after the stream has ended) if any bucket was refused or the sender aborted."""
    device = wire_device(group, model)  # headers travel as the buckets do
    refusal: WeightMismatch | None = None
    count = 0
    while True:
        try:
            header = recv_header(group, device)
        except StreamAborted as e:
            raise refusal or WeightMismatch(str(e)) from e
        if header is None:
            break
        count += 1
        try:
            dtypes = [dtype_of(d) for d in header.dtypes]
        except Exception as e:  # refused, but drained by its size on the wire
            dtypes = [_wire_dtype(d) for d in header.dtypes]
            refusal = refusal or WeightMismatch(f"bucket {count}: {e}")
        try:
            receiver.receive(
                model,
                header.names,
                dtypes,
                header.shapes,
                group,
                flattened,
                check_values,
                refusal,
                pieces=True,
            )
        except WeightMismatch as e:
            refusal = refusal or WeightMismatch(f"bucket {count}: {e}")
    if refusal is not None:
        raise refusal
    return count


def _wire_dtype(name: str) -> torch.dtype:
    """Any torch dtype by SGLang's spelling, to drain a bucket whose dtype is refused; a name
    that is no dtype leaves the stream unreadable (ValueError: the group is rebuilt)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} in a bucket header is not a torch dtype")
    return dtype

"""Bucket headers sent over a weight group ahead of each bucket's bytes: a streamed update.

SGLang's /update_weights_from_distributed takes one HTTP request per bucket, so an engine
posts its receive for bucket k+1 only after answering bucket k and parsing the next request;
on a busy host every such hand-off between threads costs a scheduling slice, and the
broadcast waits for it. An engine that advertises STREAM_CAPABILITY in its
/init_weights_update_group answer (tether's CPU engine does; SGLang does not) also serves
STREAM_ENDPOINT: one request per sync, after which its receive thread reads the buckets'
names, dtypes and shapes from the group itself, bucket after bucket, with no round trip.

On the wire, per bucket: an int64 length n, then n bytes of msgpack BucketHeader, then the
bucket's tensors, one broadcast each, in order (a flattened bucket too: the receiver lands
them in its one buffer, so the sender packs nothing). n == END closes the stream (every bucket sent); n == ABORT ends it early (the sender
failed or was stopped between buckets: receivers refuse the update, and the group stays in
step). The same code runs on gloo and NCCL: tensors live on the group's wire device.
"""

from __future__ import annotations

import msgspec
import torch

from tether.runtime.weight_group import WeightGroup, broadcast

STREAM_CAPABILITY = "tether_bucket_stream"
"""Key an engine sets true in its /init_weights_update_group answer when it serves STREAM_ENDPOINT."""
STREAM_ENDPOINT = "/update_weights_from_distributed_stream"
END = 0
ABORT = -1
MAX_HEADER_BYTES = 64 * 1024**2  # a bound far above any real bucket's names


class StreamAborted(RuntimeError):
    """The sender ended the stream before its last bucket."""


class BucketHeader(msgspec.Struct, array_like=True):
    """One bucket's tensors, in broadcast order, in SGLang's spelling (dtype 'bfloat16', ...)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def _length(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def send_header(group: WeightGroup, header: BucketHeader, device: torch.device) -> None:
    """Rank 0: announce the next bucket (blocking; two small broadcasts)."""
    payload = msgspec.msgpack.encode(header)
    broadcast(_length(len(payload), device), 0, group)
    broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), 0, group)


def send_end(group: WeightGroup, device: torch.device, *, aborted: bool = False) -> None:
    """Rank 0: close the stream (ABORT: the update is incomplete and must be refused)."""
    broadcast(_length(ABORT if aborted else END, device), 0, group)


def recv_header(group: WeightGroup, device: torch.device) -> BucketHeader | None:
    """Any other rank: the next bucket's header, None once the stream is complete;
    StreamAborted when the sender ended it early."""
    length = _length(END, device)
    broadcast(length, 0, group)
    n = int(length.item())
    if n == END:
        return None
    if n == ABORT:
        raise StreamAborted("the sender ended the weight update before its last bucket")
    if not 0 < n <= MAX_HEADER_BYTES:
        raise ValueError(f"bucket header length {n} is outside (0, {MAX_HEADER_BYTES}]")
    payload = torch.empty(n, dtype=torch.uint8, device=device)
    broadcast(payload, 0, group)
    return msgspec.msgpack.decode(payload.cpu().numpy().tobytes(), type=BucketHeader)

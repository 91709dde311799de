"""The sending side of a streamed distributed update (tether.runtime.bucket_stream), in one thread.

`BucketPump.run()` runs in a worker thread: for each bucket it broadcasts the header, starts
the bucket's broadcasts (async), fills the next bucket from the export while they are on the
wire, then waits for them; after the last bucket it closes the stream. No hand-off through the
event loop between buckets, and none on the engines' side either (they read the next header
straight after the last bucket's bytes).

`stop()` (from any thread) makes the pump end the stream with ABORT at its next bucket
boundary, and returns once the export is no longer being advanced, so the caller may drain
the rest of the stream itself. An export that raises also ends the stream with ABORT, so the
engines stop waiting and refuse the update, and the group stays usable.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from tether.runtime.bucket_stream import BucketHeader, send_end, send_header
from tether.runtime.weight_group import WeightGroup, gpu_current
from tether.sync.buckets.fill import Bucket, BucketFiller
from tether.sync.buckets.grouping import dtype_name


class PumpStopped(RuntimeError):
    """The pump was stopped before the stream's last bucket."""


def header_of(bucket: Bucket) -> BucketHeader:
    return BucketHeader(
        names=[n for n, _ in bucket.tensors],
        dtypes=[dtype_name(t) for _, t in bucket.tensors],
        shapes=[list(t.shape) for _, t in bucket.tensors],
    )


def start_broadcast(bucket: Bucket, group: WeightGroup) -> list[dist.Work]:
    """Start a bucket's broadcasts from rank 0: its flat buffer, else each tensor in order."""
    tensors = [bucket.flat] if bucket.flat is not None else [t for _, t in bucket.tensors]
    works = []
    for t in tensors:
        work = dist.broadcast(t, src=0, group=group.group, async_op=True)
        assert work is not None
        works.append(work)
    return works


class BucketPump:
    """One sync's buckets, headers first, from `filler` to every rank of `group`."""

    def __init__(self, filler: BucketFiller, group: WeightGroup, device: torch.device) -> None:
        self._filler = filler
        self._group = group
        self._device = device
        self._export = threading.Lock()  # held while the export is advanced
        self._stopped = False
        self.moved = 0
        """Bytes whose broadcast completed."""

    def stop(self) -> None:
        """No export step after this returns; the stream ends with ABORT at the next boundary."""
        self._stopped = True
        with self._export:
            pass

    def _next(self) -> Bucket | None:
        with self._export:
            if self._stopped:
                raise PumpStopped("the sync was stopped")
            return self._filler.next()

    def run(self) -> int:
        """Send every bucket and close the stream; the bytes sent. On the caller's thread, with
        the wire device current when it is a GPU (the export allocates on the current one)."""
        with gpu_current(self._device):
            return self._run()

    def _run(self) -> int:
        group, device = self._group, self._device
        failed: Exception | None = None
        try:
            bucket = self._next()
        except Exception as exc:
            bucket, failed = None, exc
        while bucket is not None:
            # A failed collective raises out of here: the group is out of step then, and the
            # caller rebuilds it.
            send_header(group, header_of(bucket), device)
            works = start_broadcast(bucket, group)
            try:
                # Filled while this bucket is on the wire: the buffer it fills was last read by
                # the previous bucket's broadcast, which has completed.
                upcoming = self._next()
            except Exception as exc:
                upcoming, failed = None, exc
            for work in works:
                work.wait()
            self.moved += bucket.nbytes
            bucket = upcoming
        if failed is not None:
            # Between buckets (every started broadcast has completed): the engines are told,
            # refuse the update, and the group stays in step.
            send_end(group, device, aborted=True)
            raise failed
        send_end(group, device)
        return self.moved

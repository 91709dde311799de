"""The actor `tether bench runtime` calls, in a module of its own: the zygote imports an actor's
module before forking it, so what this module imports is part of the measured cold start (the
bench's own imports, statistics and package metadata among them, are not an actor's)."""

from __future__ import annotations

from typing import Any


def offsets_frame() -> int:
    """Which frame of a columnar Sample batch holds the token offsets (frame 0 is the header)."""
    from tether.bench.runtime.sample_codec import FRAME_NAMES

    return 1 + FRAME_NAMES.index("token_offsets")


class BenchActor:
    """The actor every figure calls. numpy and the codec load on first use, so the cold start
    measures the runtime, not this module's imports."""

    async def echo(self, value: Any) -> Any:
        return value

    async def take_frames(self, frames: list[Any]) -> int:
        """A batch's raw columnar frames: count its Samples without decoding them."""
        return len(frames[offsets_frame()]) - 1

    async def take_samples(self, frame: Any) -> int:
        """Whole Samples received: the completed ones with a response counted, as a trainer
        filters them (each Sample's status and response length read)."""
        from tether.bench.runtime.sample_codec import SampleBatch
        from tether.rollout.sample import SampleStatus

        done = SampleStatus.COMPLETED
        return sum(1 for h in SampleBatch(frame).heads if h.status == done and h.response_length > 0)

    async def take_samples_materialized(self, frame: Any) -> int:
        """Whole Samples received and built in full (every per-token list decoded)."""
        from tether.bench.runtime.sample_codec import SampleBatch

        return len(list(SampleBatch(frame)))

"""The weight-sync slice of tether's configuration: how new weights reach the engines.

Flag names and defaults follow slime (`slime/utils/arguments.py`); tether's additions carry
names that say what they do.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tether.runtime.errors import ConfigError

ChecksumName = Literal["xxh3-128", "adler32"]
DeltaEncoding = Literal["xor", "overwrite"]


class WeightSyncConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How trained weights are exported and carried to the rollout engines."""

    update_weight_mode: Annotated[
        Literal["full", "delta"],
        Meta(
            description="Weight sync strategy: 'full' sends every tensor; 'delta' ships changed bytes (disk only)."
        ),
    ] = "full"
    update_weight_transport: Annotated[
        Literal["nccl", "disk"],
        Meta(
            description="Carrier for full syncs: 'nccl' broadcasts (gloo on CPU); 'disk' writes HF checkpoints."
        ),
    ] = "nccl"
    update_weight_buffer_size: Annotated[
        int, Meta(ge=1, description="Most bytes per broadcast bucket in a distributed weight sync.")
    ] = 512 * 1024**2
    update_weight_flattened_bucket: Annotated[
        bool,
        Meta(
            description="Broadcast each bucket as one flat byte buffer (SGLang's load_format='flattened_bucket'); engines must support it. "
            "To engines that take the streamed update (tether's CPU engine) the tensors go one by one, unpacked, and land in one flat buffer there."
        ),
    ] = False
    update_weights_interval: Annotated[
        int,
        Meta(ge=1, description="Sync weights to the engines every this many rollouts (1 under --colocate)."),
    ] = 1
    update_weight_disk_dir: Annotated[
        str | None,
        Meta(
            description="Shared directory for disk syncs: one HF checkpoint (full) or one delta per version."
        ),
    ] = None
    update_weight_disk_keep_files: Annotated[
        bool,
        Meta(description="Keep the full checkpoints written by disk syncs instead of removing old ones."),
    ] = False
    update_weight_local_checkpoint_dir: Annotated[
        str | None,
        Meta(description="Host-local directory holding the full checkpoint that deltas are applied to."),
    ] = None
    update_weight_delta_encoding: Annotated[
        DeltaEncoding,
        Meta(
            description="Delta encoding: 'xor' (new ^ old, apply once) or 'overwrite' (positions + values)."
        ),
    ] = "xor"
    update_weight_delta_checksum: Annotated[
        ChecksumName,
        Meta(description="Checksum of each new tensor's bytes, verified before a delta is published."),
    ] = "xxh3-128"
    update_weight_delta_threads: Annotated[
        int, Meta(ge=0, description="Threads that encode/compress/apply deltas; 0 uses every CPU core.")
    ] = 0
    update_weight_disk_max_shard_bytes: Annotated[
        int, Meta(ge=1, description="Largest safetensors shard written into a published HF checkpoint.")
    ] = 5 * 1000**3
    custom_update_weight_post_write_path: Annotated[
        str | None,
        Meta(
            description="'module.function' called as hook(version_dir: str) after a disk sync's files are written."
        ),
    ] = None
    update_weight_pause_mode: Annotated[
        Literal["abort", "retract", "in_place"],
        Meta(description="How /pause_generation treats in-flight requests while weights change."),
    ] = "abort"
    update_weight_request_timeout: Annotated[
        float, Meta(gt=0, description="Seconds allowed for each engine HTTP call made by a weight sync.")
    ] = 300.0
    update_weight_collective_timeout: Annotated[
        float,
        Meta(gt=0, description="Seconds allowed for each broadcast or group set-up in a distributed sync."),
    ] = 600.0
    update_weight_lock_timeout: Annotated[
        float, Meta(gt=0, description="Seconds to wait for the host-local checkpoint's file lock.")
    ] = 600.0

    def __post_init__(self) -> None:
        if self.update_weight_mode == "delta":
            if self.update_weight_transport != "disk":
                raise ConfigError(
                    "--update-weight-transport",
                    self.update_weight_transport,
                    "--update-weight-mode delta ships deltas on disk only; pass --update-weight-transport disk",
                )
            if self.update_weight_local_checkpoint_dir is None:
                raise ConfigError(
                    "--update-weight-local-checkpoint-dir",
                    None,
                    "--update-weight-mode delta needs a host-local checkpoint directory to apply deltas to",
                )
        if self.update_weight_transport == "disk" and self.update_weight_disk_dir is None:
            raise ConfigError(
                "--update-weight-disk-dir",
                None,
                "--update-weight-transport disk needs a directory to publish into",
            )
        hook = self.custom_update_weight_post_write_path
        if hook is not None and "." not in hook.strip("."):
            raise ConfigError(
                "--custom-update-weight-post-write-path", hook, "expected 'package.module.function'"
            )

    def check_colocate(self, colocate: bool) -> None:
        """Cross-slice check for the composite config: what a colocated run cannot do."""
        if colocate and self.update_weight_mode == "delta":
            raise ConfigError(
                "--update-weight-mode",
                self.update_weight_mode,
                "delta sync is disk-only and rejects --colocate",
            )
        if colocate and self.update_weights_interval > 1:
            # Colocated engines give their memory back for every train step and only a weight
            # sync takes it again: a step without a sync would leave them generating released.
            raise ConfigError(
                "--update-weights-interval",
                self.update_weights_interval,
                "--colocate releases the engines' memory every train step and only a weight sync "
                "resumes it, so it needs --update-weights-interval 1",
            )

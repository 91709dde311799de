"""Full disk sync: publish `weight_v{N:06d}/` as a complete HF checkpoint, then engines reload it.

The checkpoint is written (and the post-write hook run) while the old weights keep serving; only
the reload itself happens with generation paused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from tether.sync.config import WeightSyncConfig
from tether.sync.engine_control import (
    EngineEndpoint,
    SyncFailed,
    confirmed_entry,
    on_all,
    paused,
    reload_from_disk,
)
from tether.sync.hf_writer import load_hook, prune_versions, publish_version
from tether.sync.ledger import LedgerEntry


class FullDiskTransport:
    """Publishes full checkpoints under --update-weight-disk-dir and reloads every engine from them."""

    name = "disk"

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        cfg: WeightSyncConfig,
        *,
        base_dir: Path,
        post_write_hook: Callable[[str], object] | None = None,
    ) -> None:
        if cfg.update_weight_disk_dir is None:
            raise SyncFailed("--update-weight-disk-dir is required for disk sync")
        self.engines = list(engines)
        self.cfg = cfg
        self.base_dir = Path(base_dir)
        self.disk_dir = Path(cfg.update_weight_disk_dir)
        hook_path = cfg.custom_update_weight_post_write_path
        self.hook = post_write_hook or (load_hook(hook_path) if hook_path else None)

    async def sync(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> LedgerEntry:
        cfg = self.cfg
        started_at = time.time()
        t0 = time.perf_counter()
        path = await asyncio.to_thread(
            publish_version,
            tensors,
            self.disk_dir,
            version=version,
            base_dir=self.base_dir,
            max_shard_bytes=cfg.update_weight_disk_max_shard_bytes,
            checksum=cfg.update_weight_delta_checksum,
        )
        if self.hook is not None:
            await asyncio.to_thread(self.hook, str(path))
        moved = sum(p.stat().st_size for p in path.iterdir() if p.suffix == ".safetensors")
        timeout = cfg.update_weight_request_timeout
        async with paused(self.engines, cfg.update_weight_pause_mode, timeout) as pause_clock:
            await on_all(self.engines, lambda e: reload_from_disk(e, str(path), version, timeout))
            pause_s = pause_clock()
        entry = await confirmed_entry(
            self.engines,
            timeout,
            version=version,
            transport=self.name,
            bytes_moved=moved * len(self.engines),
            pause_seconds=pause_s,
            perf_started=t0,
            started_at=started_at,
            note=str(path),
        )
        # Only once every engine confirmed the new version: until then the previous one is what a
        # restarted engine catches up to, so it must stay on disk.
        if entry.ok and not cfg.update_weight_disk_keep_files:
            await asyncio.to_thread(prune_versions, self.disk_dir, {version})
        return entry

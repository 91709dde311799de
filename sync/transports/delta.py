"""Delta disk sync: diff against a CPU baseline, publish the delta, patch each host's local checkpoint.

The first sync captures the baseline from --hf-checkpoint (the checkpoint every host's local
store is seeded from). Each sync keeps the new state as the next baseline. Hosts apply under
their store's file lock before generation is paused; a host that refuses a delta (wrong base,
gap, checksum) is repaired from a full version written from the trainer's in-memory state.
Engines then reload from their host's store through /update_weights_from_disk.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from tether.runtime.files.atomic_file import staged_dir
from tether.sync.checkpoint_files import TORCH_TO_ST, open_checkpoint, tensor_bytes
from tether.sync.config import WeightSyncConfig
from tether.sync.delta import DeltaRefused, RawTensor, encode_delta
from tether.sync.delta_format import DeltaIndex, delta_dir_name
from tether.sync.engine_control import (
    EngineEndpoint,
    SyncFailed,
    confirmed_entry,
    on_all,
    paused,
    reload_from_disk,
)
from tether.sync.hf_writer import load_hook, published_versions, write_hf_checkpoint
from tether.sync.ledger import LedgerEntry
from tether.sync.local_store import ApplyOutcome, LocalCheckpointStore


class DeltaDiskTransport:
    """--update-weight-mode delta: the trainer side plus the appliers of the hosts it can reach."""

    name = "delta"

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        cfg: WeightSyncConfig,
        *,
        hf_checkpoint: Path,
        stores: Mapping[str, LocalCheckpointStore] | None = None,
        base_version: int = 0,
        post_write_hook: Callable[[str], object] | None = None,
    ) -> None:
        """stores: engine name -> the local store on that engine's host (default: one store, this host)."""
        if cfg.update_weight_disk_dir is None or cfg.update_weight_local_checkpoint_dir is None:
            raise SyncFailed(
                "delta sync needs --update-weight-disk-dir and --update-weight-local-checkpoint-dir"
            )
        self.engines = list(engines)
        self.cfg = cfg
        self.hf_checkpoint = Path(hf_checkpoint)
        self.disk_dir = Path(cfg.update_weight_disk_dir)
        if stores is None:
            shared = LocalCheckpointStore(
                Path(cfg.update_weight_local_checkpoint_dir),
                lock_timeout=cfg.update_weight_lock_timeout,
                threads=cfg.update_weight_delta_threads,
            )
            stores = {e.name: shared for e in self.engines}
        missing = [e.name for e in self.engines if e.name not in stores]
        if missing:
            raise SyncFailed(f"no local store given for engines {missing}")
        self.stores = dict(stores)
        self.baseline: dict[str, torch.Tensor] | None = None
        self.weight_map: dict[str, str] = {}
        self.base_version = base_version
        hook_path = cfg.custom_update_weight_post_write_path
        self.hook = post_write_hook or (load_hook(hook_path) if hook_path else None)
        self.last_index: DeltaIndex | None = None

    def _unique_stores(self) -> list[LocalCheckpointStore]:
        seen: dict[Path, LocalCheckpointStore] = {}
        for store in self.stores.values():
            seen.setdefault(store.root.resolve(), store)
        return list(seen.values())

    def capture_baseline(self) -> None:
        """Load --hf-checkpoint into CPU memory and seed every host store from it (once)."""
        with open_checkpoint(self.hf_checkpoint) as view:
            self.baseline = {name: view.tensor(name) for name in sorted(view.slots)}
            self.weight_map = dict(view.weight_map)
        for store in self._unique_stores():
            store.seed(
                self.hf_checkpoint, version=self.base_version, checksum=self.cfg.update_weight_delta_checksum
            )

    def _collect(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        assert self.baseline is not None
        new: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            base = self.baseline.get(name)
            if base is None:
                raise SyncFailed(
                    f"exported tensor {name!r} is not in --hf-checkpoint; deltas need one layout"
                )
            if tuple(t.shape) != tuple(base.shape):
                raise SyncFailed(
                    f"exported tensor {name!r} has shape {list(t.shape)}, the checkpoint {list(base.shape)}"
                )
            # The engines' checkpoint dtype is canonical: cast the trainer's tensor to it.
            new[name] = t.detach().to(device="cpu", dtype=base.dtype).contiguous().clone()
        for name, base in self.baseline.items():
            new.setdefault(name, base)  # not exported (e.g. tied weights): unchanged
        return new

    def _write_delta(self, new: dict[str, torch.Tensor], version: int) -> tuple[Path, DeltaIndex]:
        assert self.baseline is not None

        def raw(state: dict[str, torch.Tensor]) -> dict[str, RawTensor]:
            return {
                n: RawTensor(TORCH_TO_ST[t.dtype], list(t.shape), tensor_bytes(t)) for n, t in state.items()
            }

        out = self.disk_dir / delta_dir_name(version)
        with staged_dir(out) as staging:
            index = encode_delta(
                raw(self.baseline),
                raw(new),
                staging,
                version=version,
                base_version=self.base_version,
                weight_map=self.weight_map,
                encoding=self.cfg.update_weight_delta_encoding,
                checksum=self.cfg.update_weight_delta_checksum,
                threads=self.cfg.update_weight_delta_threads,
            )
        return out, index

    def _write_full(self, new: dict[str, torch.Tensor], version: int) -> Path:
        """A full version in the same shard layout, for hosts whose chain is broken."""
        out = self.disk_dir / f"full_v{version:06d}"
        if not out.exists():
            write_hf_checkpoint(
                new.items(),
                out,
                version=version,
                base_dir=self.hf_checkpoint,
                checksum=self.cfg.update_weight_delta_checksum,
                layout=self.weight_map,  # the hosts' shard layout, so later deltas still apply
            )
        return out

    def _apply_on_hosts(
        self, delta: Path, new: dict[str, torch.Tensor], version: int
    ) -> dict[str, ApplyOutcome]:
        outcomes: dict[str, ApplyOutcome] = {}
        for store in self._unique_stores():
            try:
                outcomes[str(store.root)] = store.apply(delta)
            except DeltaRefused:
                outcomes[str(store.root)] = store.repair(self._write_full(new, version))
        return outcomes

    async def sync(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> LedgerEntry:
        cfg = self.cfg
        started_at = time.time()
        t0 = time.perf_counter()
        if self.baseline is None:
            await asyncio.to_thread(self.capture_baseline)
        if version != self.base_version + 1:
            raise SyncFailed(f"delta sync to version {version} from baseline version {self.base_version}")
        new = await asyncio.to_thread(self._collect, tensors)
        delta, index = await asyncio.to_thread(self._write_delta, new, version)
        if self.hook is not None:
            await asyncio.to_thread(self.hook, str(delta))
        await asyncio.to_thread(self._apply_on_hosts, delta, new, version)
        timeout = cfg.update_weight_request_timeout
        async with paused(self.engines, cfg.update_weight_pause_mode, timeout) as pause_clock:
            await on_all(self.engines, lambda e: self._reload(e, version))
            pause_s = pause_clock()
        # Every engine reloaded the new version: it is the baseline of the next delta.
        self.baseline, self.base_version, self.last_index = new, version, index
        if not cfg.update_weight_disk_keep_files:
            await asyncio.to_thread(self._prune, version)
        return await confirmed_entry(
            self.engines,
            timeout,
            version=version,
            transport=self.name,
            bytes_moved=index.delta_bytes,
            pause_seconds=pause_s,
            perf_started=t0,
            started_at=started_at,
            note=f"{len(index.changed())}/{len(index.tensors)} tensors changed; {index.full_bytes} full bytes",
        )

    async def _reload(self, engine: EngineEndpoint, version: int) -> None:
        store = self.stores[engine.name]
        path = store.current_path()
        if path is None or store.version() != version:
            raise SyncFailed(f"engine {engine.name}: its host store {store.root} is not at version {version}")
        await reload_from_disk(engine, str(path), version, self.cfg.update_weight_request_timeout)

    async def catch_up(self, engine: EngineEndpoint) -> None:
        """Bring one engine (e.g. restarted from --hf-checkpoint) to its host store's current version."""
        store = self.stores[engine.name]
        path, version = store.current_path(), store.version()
        if path is None or version is None:
            raise SyncFailed(f"engine {engine.name}: host store {store.root} has no version yet")
        await reload_from_disk(engine, str(path), version, self.cfg.update_weight_request_timeout)

    def _prune(self, version: int) -> None:
        # The previous delta stays for a host that is mid-apply; older ones and full copies go.
        for prefix in ("delta_v", "full_v"):
            for v, path in published_versions(self.disk_dir, prefix).items():
                if v < version - (1 if prefix == "delta_v" else 0):
                    shutil.rmtree(path, ignore_errors=True)

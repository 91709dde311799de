"""Write a complete Hugging Face checkpoint directory from (hf_name, tensor) pairs, atomically.

The directory holds safetensors shards no larger than a limit, `model.safetensors.index.json`,
the base model's config/generation config/tokenizer files, and tether's marker with the version
and a checksum of every tensor. It is written into `<dir>.tmp-<pid>` and renamed into place, so
an engine reading `weight_v{N:06d}/` never sees a partial checkpoint.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from tether.runtime.files.atomic_file import staged_dir
from tether.runtime.files.safe_paths import contained
from tether.sync.checkpoint_files import (
    INDEX_NAME,
    MARKER_NAME,
    WeightsMarker,
    is_weight_file,
    open_checkpoint,
    tensor_bytes,
)
from tether.sync.checksum import checksum_fn

VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def copy_model_files(base_dir: Path, out_dir: Path) -> list[str]:
    """Copy config, generation config and tokenizer files (everything but weights) from base_dir."""
    copied = []
    for entry in sorted(base_dir.iterdir()):
        if entry.is_file() and not entry.name.startswith(".") and not is_weight_file(entry.name):
            shutil.copyfile(entry, out_dir / entry.name)
            copied.append(entry.name)
    return copied


def _write_layout(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, layout: Mapping[str, str], checksum: str
) -> tuple[dict[str, str], dict[str, str], int]:
    """Write tensors into exactly the shard files `layout` names (name -> file)."""
    digest = checksum_fn(checksum)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    checksums: dict[str, str] = {}
    total = 0
    for name, tensor in tensors:
        if name not in layout:
            raise ValueError(f"tensor {name!r} is not in the shard layout")
        t = tensor.detach().to("cpu").contiguous()
        checksums[name] = digest(tensor_bytes(t))
        groups.setdefault(layout[name], {})[name] = t
        total += t.numel() * t.element_size()
    missing = sorted(set(layout) - set(checksums))
    if missing:
        raise ValueError(f"the shard layout names tensors that were not given: {missing[:5]}")
    for shard, group in groups.items():
        ptrs: set[int] = set()
        for name, t in group.items():
            if t.numel() and t.data_ptr() in ptrs:
                group[name] = t.clone()
            ptrs.add(group[name].data_ptr())
        # The layout may come from another checkpoint's index: its names must stay in out_dir.
        path = contained(out_dir, shard, entry="shard layout file")
        save_file(group, str(path), metadata={"format": "pt"})
    return dict(layout), checksums, total


def _write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int, checksum: str
) -> tuple[dict[str, str], dict[str, str], int]:
    digest = checksum_fn(checksum)
    shard_files: list[tuple[str, list[str]]] = []
    checksums: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        tmp_name = f"shard-{len(shard_files):05d}.safetensors"
        save_file(pending, str(out_dir / tmp_name), metadata={"format": "pt"})
        shard_files.append((tmp_name, list(pending)))
        pending, pending_bytes = {}, 0

    seen_ptrs: set[int] = set()
    for name, tensor in tensors:
        if name in checksums:
            raise ValueError(f"tensor name {name!r} appears twice in the exported weights")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
            seen_ptrs = set()
        if t.numel() and t.data_ptr() in seen_ptrs:
            t = t.clone()  # safetensors refuses two names sharing storage (tied weights)
        if t.numel():
            seen_ptrs.add(t.data_ptr())
        checksums[name] = digest(tensor_bytes(t))
        pending[name] = t
        pending_bytes += size
        total += size
    flush()
    if not shard_files:
        raise ValueError("no tensors to write: the exported weights were empty")
    count = len(shard_files)
    mapping: dict[str, str] = {}
    for i, (tmp_name, names) in enumerate(shard_files):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (out_dir / tmp_name).rename(out_dir / final)
        mapping.update(dict.fromkeys(names, final))
    return mapping, checksums, total


def write_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    version: int,
    base_dir: Path | None = None,
    max_shard_bytes: int = 5 * 1000**3,
    checksum: str = "xxh3-128",
    layout: Mapping[str, str] | None = None,
) -> WeightsMarker:
    """Write the tensors as a full HF checkpoint at out_dir, atomically; return its marker.

    Shards are cut at max_shard_bytes, or follow `layout` (tensor name -> shard file) exactly.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(out_dir) as staging:
        if layout is not None:
            mapping, checksums, total = _write_layout(tensors, staging, layout, checksum)
        else:
            mapping, checksums, total = _write_shards(tensors, staging, max_shard_bytes, checksum)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(mapping.items()))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if base_dir is not None:
            copy_model_files(Path(base_dir), staging)
        with open_checkpoint(staging) as view:  # each tensor's header entry, as written
            written = dict(view.slots)
        marker = WeightsMarker(version=version, checksum=checksum, checksums=checksums, layout=written)
        (staging / MARKER_NAME).write_bytes(msgspec.json.format(msgspec.json.encode(marker)))
    return marker


def publish_version(
    tensors: Iterable[tuple[str, torch.Tensor]],
    disk_dir: Path,
    *,
    version: int,
    base_dir: Path | None,
    max_shard_bytes: int = 5 * 1000**3,
    checksum: str = "xxh3-128",
) -> Path:
    """Write `<disk_dir>/weight_v{N:06d}/` as a complete checkpoint; return its path."""
    out = Path(disk_dir) / version_dir_name(version)
    write_hf_checkpoint(
        tensors, out, version=version, base_dir=base_dir, max_shard_bytes=max_shard_bytes, checksum=checksum
    )
    return out


def published_versions(disk_dir: Path, prefix: str = "weight_v") -> dict[int, Path]:
    """Published version directories under disk_dir (staging and half-removed ones excluded)."""
    found: dict[int, Path] = {}
    if not disk_dir.exists():
        return found
    pattern = re.compile(rf"^{re.escape(prefix)}(\d{{6,}})$")
    for entry in disk_dir.iterdir():
        m = pattern.match(entry.name)
        if m and entry.is_dir():
            found[int(m.group(1))] = entry
    return found


def prune_versions(disk_dir: Path, keep: set[int], prefix: str = "weight_v") -> list[int]:
    """Remove published versions not in keep (and stale staging dirs of this prefix)."""
    removed = []
    for version, path in sorted(published_versions(disk_dir, prefix).items()):
        if version not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(version)
    return removed


def load_hook(path: str) -> Callable[[str], object]:
    """Import the 'module.function' named by --custom-update-weight-post-write-path."""
    module_name, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--custom-update-weight-post-write-path={path!r}: cannot import: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"--custom-update-weight-post-write-path={path!r}: not callable")
    return fn  # type: ignore[no-any-return]

"""`tether weights`: operator tools for published weights, the same code the transports run.

  tether weights diff --base DIR --new DIR --out DIR [--encoding xor|overwrite] [--checksum xxh3-128]
  tether weights apply --target STORE --delta DIR
  tether weights verify DIR            (a delta, a local store, or a published checkpoint)
  tether weights seed --target STORE --from DIR [--version N]
  tether weights repair --target STORE --full DIR

Each prints one JSON line describing what it did and exits non-zero with a clear message when it
refuses (wrong base, version gap, checksum mismatch, corrupted or truncated files, a safetensors
header that is invalid or differs from the one recorded, a file name in an index or delta that
would leave its directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from tether.runtime.files.atomic_file import staged_dir
from tether.sync.checkpoint_files import CheckpointError, checkpoint_version, verify_checkpoint
from tether.sync.checksum import CHECKSUMS
from tether.sync.delta import DeltaRefused, diff_checkpoints, verify_delta
from tether.sync.delta_format import DELTA_INDEX, DeltaFormatError
from tether.sync.local_store import LocalCheckpointStore, StoreError, is_checkpoint, is_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    diff = sub.add_parser("diff", help="Write the delta from one checkpoint to another.")
    diff.add_argument(
        "--base", type=Path, required=True, help="Checkpoint (or local store) the delta starts from."
    )
    diff.add_argument("--new", type=Path, required=True, help="Checkpoint the delta produces.")
    diff.add_argument("--out", type=Path, required=True, help="Delta directory to write (atomically).")
    diff.add_argument("--encoding", choices=["xor", "overwrite"], default="xor", help="Delta encoding.")
    diff.add_argument(
        "--checksum", choices=sorted(CHECKSUMS), default="xxh3-128", help="Per-tensor checksum."
    )
    diff.add_argument("--base-version", type=int, default=None, help="Override the base's version.")
    diff.add_argument("--version", type=int, default=None, help="Override the new version (default base+1).")
    diff.add_argument("--threads", type=int, default=0, help="Worker threads (0 = every core).")
    apply = sub.add_parser("apply", help="Apply a delta to a host-local store, under its file lock.")
    apply.add_argument("--target", type=Path, required=True, help="Local store directory.")
    apply.add_argument("--delta", type=Path, required=True, help="Delta directory.")
    apply.add_argument("--threads", type=int, default=0, help="Worker threads (0 = every core).")
    apply.add_argument("--lock-timeout", type=float, default=600.0, help="Seconds to wait for the lock.")
    verify = sub.add_parser(
        "verify", help="Check version, base and every checksum of a delta, store or checkpoint."
    )
    verify.add_argument("path", type=Path, help="Delta directory, local store, or published checkpoint.")
    seed = sub.add_parser("seed", help="Start a local store from a full checkpoint.")
    seed.add_argument("--target", type=Path, required=True, help="Local store directory.")
    seed.add_argument("--from", dest="source", type=Path, required=True, help="Full HF checkpoint.")
    seed.add_argument(
        "--version", type=int, default=None, help="Version of a plain HF checkpoint (default 0)."
    )
    repair = sub.add_parser("repair", help="Reset a local store to a verified full version.")
    repair.add_argument("--target", type=Path, required=True, help="Local store directory.")
    repair.add_argument(
        "--full", type=Path, required=True, help="Published full checkpoint (with its marker)."
    )


def _checkpoint_dir(path: Path, flag: str) -> Path:
    if is_store(path):
        resolved = LocalCheckpointStore(path).current_path()
        assert resolved is not None
        return resolved
    if not is_checkpoint(path):
        raise CheckpointError(f"{flag}={str(path)!r}: not a checkpoint directory or local store")
    return path


def _diff(args: argparse.Namespace) -> dict[str, object]:
    base = _checkpoint_dir(args.base, "--base")
    new = _checkpoint_dir(args.new, "--new")
    base_version = args.base_version if args.base_version is not None else checkpoint_version(base)
    version = args.version if args.version is not None else checkpoint_version(new, default=base_version + 1)
    if version <= base_version:
        raise DeltaFormatError(f"--version={version} must be after the base's version {base_version}")
    with staged_dir(args.out) as staging:
        index = diff_checkpoints(
            base,
            new,
            staging,
            base_version=base_version,
            version=version,
            encoding=args.encoding,
            checksum=args.checksum,
            threads=args.threads,
        )
    return {
        "delta": str(args.out),
        "version": index.version,
        "base_version": index.base_version,
        "changed_tensors": len(index.changed()),
        "tensors": len(index.tensors),
        "delta_bytes": index.delta_bytes,
        "full_bytes": index.full_bytes,
    }


def _verify(path: Path) -> dict[str, object]:
    if (path / DELTA_INDEX).exists():
        index = verify_delta(path)
        return {
            "kind": "delta",
            "version": index.version,
            "base_version": index.base_version,
            "encoding": index.encoding,
            "checksum": index.checksum,
            "frames_verified": sum(len(t.frames) for t in index.tensors.values()),
        }
    if is_store(path):
        marker = LocalCheckpointStore(path).verify()
        kind = "store"
    else:
        marker = verify_checkpoint(path)
        kind = "checkpoint"
    return {
        "kind": kind,
        "version": marker.version,
        "checksum": marker.checksum,
        "tensors_verified": len(marker.checksums),
    }


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "diff":
            result: object = _diff(args)
        elif args.action == "apply":
            if not is_store(args.target):
                raise StoreError(
                    f"--target={str(args.target)!r} is not a local store (no 'current' link); "
                    "start one with `tether weights seed --target STORE --from CHECKPOINT`"
                )
            store = LocalCheckpointStore(args.target, lock_timeout=args.lock_timeout, threads=args.threads)
            result = store.apply(args.delta)
        elif args.action == "verify":
            result = _verify(args.path)
        elif args.action == "seed":
            result = LocalCheckpointStore(args.target).seed(args.source, version=args.version)
        else:
            result = LocalCheckpointStore(args.target).repair(args.full)
    except (DeltaRefused, DeltaFormatError, CheckpointError, StoreError, FileNotFoundError) as exc:
        print(f"tether weights {args.action}: refused: {exc}", file=sys.stderr)
        return 1
    print(msgspec.json.encode(result).decode())
    return 0

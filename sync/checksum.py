"""Checksums of tensor bytes, by the names the --update-weight-delta-checksum flag accepts."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import xxhash

# Anything exposing the buffer protocol (bytes, memoryview, numpy arrays); xxhash/zlib accept all.
Buffer = Any


def _xxh3_128(data: Buffer) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _adler32(data: Buffer) -> str:
    return f"{zlib.adler32(data) & 0xFFFFFFFF:08x}"


def frame_digest(data: Buffer) -> str:
    """Integrity digest of one compressed delta frame (catches a corrupted or truncated file early)."""
    return xxhash.xxh3_64_hexdigest(data)


CHECKSUMS: dict[str, Callable[[Buffer], str]] = {"xxh3-128": _xxh3_128, "adler32": _adler32}


def checksum_fn(name: str) -> Callable[[Buffer], str]:
    """The digest function for a checksum name; a clear error names an unknown one."""
    try:
        return CHECKSUMS[name]
    except KeyError:
        raise ValueError(f"checksum={name!r}: unknown algorithm; choose one of {sorted(CHECKSUMS)}") from None

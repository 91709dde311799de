"""The receipt's package list: each installed distribution's Name and Version read from its
metadata file's headers, exactly as the email parser of `Distribution.metadata` reads them."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tether.records.run_dir import name_and_version, package_versions


def test_every_installed_distribution_reads_as_its_metadata_says() -> None:
    dists = list(importlib.metadata.distributions())
    assert len(dists) > 20  # torch, megatron-core, msgspec, ... in this environment
    for dist in dists:
        assert name_and_version(dist) == (dist.metadata["Name"], dist.version), dist._path  # type: ignore[attr-defined]
    slow = {d.metadata["Name"]: d.version for d in dists if d.metadata["Name"]}
    assert package_versions() == dict(sorted(slow.items(), key=lambda kv: kv[0].lower()))


def _dist(tmp_path: Path, metadata: str, file: str = "METADATA") -> importlib.metadata.Distribution:
    info = tmp_path / "pkg-1.0.dist-info"
    info.mkdir()
    (info / file).write_text(metadata)
    return importlib.metadata.PathDistribution(info)


def test_headers_end_at_the_first_blank_line(tmp_path: Path) -> None:
    dist = _dist(tmp_path, "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\nName: not-a-header\n")
    assert name_and_version(dist) == ("pkg", "1.0")


def test_an_egg_info_reads_its_pkg_info(tmp_path: Path) -> None:
    dist = _dist(tmp_path, "Metadata-Version: 1.0\nName: old\nVersion: 0.1\n", file="PKG-INFO")
    assert name_and_version(dist) == ("old", "0.1")


def test_metadata_without_a_version_header_falls_back_to_the_parser(tmp_path: Path) -> None:
    dist = _dist(tmp_path, "Metadata-Version: 2.1\nName: bare\n\nbody\n")
    assert name_and_version(dist) == ("bare", dist.version) == ("bare", None)

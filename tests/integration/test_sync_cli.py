"""`tether weights diff/apply/verify/seed/repair` as an operator runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tether.sync.hf_writer import write_hf_checkpoint


def tether(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tether", "weights", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    a = {"a.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16), "b.bias": torch.zeros(64)}
    b = {"a.weight": a["a.weight"].clone(), "b.bias": a["b.bias"].clone()}
    b["a.weight"][3, :5] += 1.0
    return a, b


def test_cli_diff_apply_verify_roundtrip_and_refusals(tmp_path: Path) -> None:
    a, b = states()
    (tmp_path / "base").mkdir()
    # The base is a plain HF checkpoint (no tether marker): it counts as version 0.
    write_hf_checkpoint(a.items(), tmp_path / "v0", version=0)
    write_hf_checkpoint(b.items(), tmp_path / "v1", version=1)
    for p in (tmp_path / "v0").iterdir():
        if p.name != "tether_weights.json":
            (tmp_path / "base" / p.name).write_bytes(p.read_bytes())

    r = tether(
        "diff", "--base", str(tmp_path / "base"), "--new", str(tmp_path / "v1"), "--out", str(tmp_path / "d1")
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == 1 and out["base_version"] == 0 and out["changed_tensors"] == 1

    r = tether("verify", str(tmp_path / "d1"))
    assert r.returncode == 0 and json.loads(r.stdout)["kind"] == "delta"

    r = tether("apply", "--target", str(tmp_path / "store"), "--delta", str(tmp_path / "d1"))
    assert r.returncode == 1 and "not a local store" in r.stderr

    r = tether("seed", "--target", str(tmp_path / "store"), "--from", str(tmp_path / "base"))
    assert r.returncode == 0, r.stderr
    r = tether("apply", "--target", str(tmp_path / "store"), "--delta", str(tmp_path / "d1"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 1 and json.loads(r.stdout)["changed"] is True
    r = tether("apply", "--target", str(tmp_path / "store"), "--delta", str(tmp_path / "d1"))
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] is False

    r = tether("verify", str(tmp_path / "store"))
    assert r.returncode == 0 and json.loads(r.stdout) == {
        "kind": "store",
        "version": 1,
        "checksum": "xxh3-128",
        "tensors_verified": 2,
    }

    # A corrupted shard in a published checkpoint fails verification, naming the tensor.
    shard = next((tmp_path / "v1").glob("model-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 1
    shard.write_bytes(bytes(raw))
    r = tether("verify", str(tmp_path / "v1"))
    assert r.returncode == 1 and "checksum" in r.stderr

    # A delta diffed from a damaged copy of the base is refused (base checksums), then repaired.
    write_hf_checkpoint(b.items(), tmp_path / "v5", version=5)
    r = tether(
        "diff", "--base", str(tmp_path / "v1"), "--new", str(tmp_path / "v5"), "--out", str(tmp_path / "d5")
    )
    assert r.returncode == 0, r.stderr
    r = tether("apply", "--target", str(tmp_path / "store"), "--delta", str(tmp_path / "d5"))
    assert r.returncode == 1 and "refused" in r.stderr
    r = tether("repair", "--target", str(tmp_path / "store"), "--full", str(tmp_path / "v5"))
    assert r.returncode == 0 and json.loads(r.stdout)["version"] == 5

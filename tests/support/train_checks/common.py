"""Helpers shared by the torchrun check scripts: tiny perturbed HF models, result files."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# Check scripts are run as files by torchrun; make sibling imports work.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher import make_batch, shard_and_plan  # noqa: F401  (re-exported for the scripts)

# Megatron and transformers announce missing optional kernels at import; expected on CPU.
warnings.filterwarnings("ignore", category=UserWarning)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3_tied": {"arch": "qwen3", "tie_embeddings": True},
}


def _write_qwen3_next(path: Path, seed: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for support.*
    from support.qwen3_next_model import write_qwen3_next

    write_qwen3_next(path, seed=seed)


# Families whose tiny model transformers builds here (tests/support), not tether's init-model.
HF_WRITTEN: dict[str, Callable[[Path, int], None]] = {"qwen3_next": _write_qwen3_next}


def make_models(
    root: Path,
    layers: int = 2,
    families: dict[str, dict[str, Any]] | None = None,
    config_changes: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Path]:
    """Write each family's tiny model under root (default: FAMILIES), with every weight perturbed
    (biases and norms start at 0/1 in a fresh init, which would hide layout mistakes) and its
    `config_changes` merged into config.json. Models already there are kept."""
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    out = {}
    for i, (name, kw) in enumerate((families or FAMILIES).items()):
        path = root / name
        if not (path / "config.json").exists():
            if kw.get("arch") in HF_WRITTEN:
                HF_WRITTEN[str(kw["arch"])](path, seed=i)
            else:
                write_tiny_model(path, TinyModelSpec(seed=i, **{"layers": layers, **kw}))
            if config_changes and name in config_changes:
                config = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({**config, **config_changes[name]}))
            f = path / "model.safetensors"
            tensors = load_file(str(f))
            g = torch.Generator().manual_seed(100 + i)
            perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
            save_file(perturbed, str(f), metadata={"format": "pt"})
        out[name] = path
    return out


class Results:
    """Per-rank check outcomes written as JSON for the pytest side to assert on."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.path = out_dir / f"rank{rank}.json"
        self.data: dict[str, Any] = {}
        self.rank = rank

    def record(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
            self.data[name] = {"ok": True, "value": value}
            return value
        except Exception:
            self.data[name] = {"ok": False, "error": traceback.format_exc()}
            print(f"[rank {self.rank}] {name} FAILED\n{traceback.format_exc()}", flush=True)
            return None
        finally:
            self.flush()

    def set(self, name: str, value: Any) -> None:
        self.data[name] = {"ok": True, "value": value}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def params_digest(chunks: list[Any], arch: Any) -> dict[str, float]:
    """Per-HF-tensor sums of this stage's full weights (collective over the TP group)."""
    from tether.train.checkpoint.export import iter_hf_weights

    return {
        name: float(t.double().sum()) + float(t.double().abs().sum())
        for name, t in iter_hf_weights(chunks, arch)
    }

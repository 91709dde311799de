"""Reading a Hugging Face safetensors checkpoint (single file, or sharded with an index).

The HF ↔ Megatron conversion itself goes through mbridge (`tether.train.model.bridge`); this module only
reads tensors by HF name, every shard path kept inside the checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tether.runtime.errors import ConfigError
from tether.runtime.files.safe_paths import contained


class HFWeights:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            for name, shard in weight_map.items():
                # Joined to the directory below: a name leaving it would read any file.
                contained(self.dir, shard, entry=f"{index.name} weight_map[{name!r}]")
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ConfigError("--hf-checkpoint", str(hf_dir), "contains no *.safetensors weights")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    weight_map.update(dict.fromkeys(h.keys(), f.name))
        self.weight_map = weight_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        shard = contained(self.dir, self.weight_map[name], entry=f"weight_map[{name!r}]")
        with safe_open(str(shard), framework="pt") as h:
            return h.get_tensor(name)

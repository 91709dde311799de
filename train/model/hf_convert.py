"""Reading a Hugging Face safetensors checkpoint (single file, or sharded with an index), and the
form a written checkpoint keeps from it.

The HF ↔ Megatron conversion itself goes through mbridge (`tether.train.model.bridge`), which names
each routed expert's tensors apart (`experts.{e}.gate_proj.weight`, ...). Checkpoints transformers
writes for some families (Qwen3.5-MoE as published) hold them fused, all experts in one tensor:
`experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`experts.down_proj` [E, H, I]. `HFWeights.get` serves an expert's slice of those by its own name;
`in_base_form` fuses them back when the base checkpoint has them fused, and adds the tensors the
trainer does not hold (`ModelArch.hf_kept_prefixes`), so a saved checkpoint loads as the original.
Every shard path is kept inside the checkpoint directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
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
        self._cached: tuple[str, torch.Tensor] | None = None

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            expert = EXPERT_NAME.match(name)
            if expert is not None and fused_name(expert) in self.weight_map:
                return self._expert_slice(expert)
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        shard = contained(self.dir, self.weight_map[name], entry=f"weight_map[{name!r}]")
        with safe_open(str(shard), framework="pt") as h:
            return h.get_tensor(name)

    def fused_experts(self) -> bool:
        """Whether the checkpoint holds routed experts fused (module doc)."""
        return any(n.endswith(".experts.gate_up_proj") for n in self.weight_map)

    def _expert_slice(self, expert: re.Match[str]) -> torch.Tensor:
        name = fused_name(expert)
        if self._cached is None or self._cached[0] != name:  # an expert's neighbours come next
            self._cached = (name, self.get(name))
        fused, index = self._cached[1], int(expert["index"])
        if index >= fused.shape[0]:
            raise KeyError(
                f"{self.dir}: checkpoint has no tensor {expert[0]!r} ({name} holds {fused.shape[0]})"
            )
        whole = fused[index]
        if expert["proj"] == "down_proj":
            return whole.clone()
        gate, up = whole.chunk(2)
        return (gate if expert["proj"] == "gate_proj" else up).clone()


# One routed expert's tensor under its own name (mbridge's), and the fused tensor that holds it.
EXPERT_NAME = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fused_name(expert: re.Match[str]) -> str:
    suffix = "down_proj" if expert["proj"] == "down_proj" else "gate_up_proj"
    return f"{expert['experts']}.{suffix}"


def in_base_form(
    tensors: Iterable[tuple[str, torch.Tensor]],
    base: HFWeights,
    num_experts: int | None,
    kept: tuple[str, ...],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` (the trainer's export) in the base checkpoint's form (module doc): routed experts fused
    where the base holds them fused, then every base tensor under a `kept` prefix, unchanged."""
    fuse = bool(num_experts) and base.fused_experts()
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    written: set[str] = set()
    for name, tensor in tensors:
        expert = EXPERT_NAME.match(name) if fuse else None
        if expert is None:
            written.add(name)
            yield name, tensor
            continue
        fused = fused_name(expert)
        parts = pending.setdefault(fused, {})
        parts[(int(expert["index"]), expert["proj"])] = tensor
        per_expert = 1 if expert["proj"] == "down_proj" else 2
        if len(parts) < per_expert * int(num_experts or 0):
            continue
        del pending[fused]
        if per_expert == 1:
            whole = torch.stack([parts[(e, "down_proj")] for e in range(int(num_experts or 0))])
        else:
            whole = torch.stack(
                [
                    torch.cat((parts[(e, "gate_proj")], parts[(e, "up_proj")]))
                    for e in range(int(num_experts or 0))
                ]
            )
        written.add(fused)
        yield fused, whole
    if pending:
        incomplete = sorted(pending)[:3]
        raise ValueError(f"the export left routed experts incomplete for the fused tensors {incomplete}")
    for name in base.names():
        if name.startswith(kept) and name not in written:
            yield name, base.get(name)

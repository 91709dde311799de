"""--freeze-params-name-list / --only-train-params-name-list: which of the actor's parameters train.

slime's meaning (slime/backends/megatron_utils/model_provider.py, freeze_model_params): each
pattern is a Python regex tried with `re.search` on the names of the Megatron model chunk this
rank builds (`decoder.layers.0.self_attention.linear_qkv.weight`, `embedding.word_embeddings.weight`,
`output_layer.weight`; layer numbers are the chunk's own, counted from 0 on every pipeline stage,
as in slime). --only-train-params-name-list freezes every parameter no pattern matches;
--freeze-params-name-list freezes those one matches. A frozen parameter gets requires_grad False
before DDP and the optimizer are built, so it has no gradient buffer and no optimizer state.

slime accepts patterns that match nothing. tether refuses a list none of whose patterns matches a
parameter on any rank (the flag would do nothing, or freeze everything), and warns of each single
pattern that matches nothing.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tether.runtime.errors import ConfigError


@dataclass
class FreezeResult:
    """What the lists did on this rank's chunk."""

    flag: str | None  # the flag that chose, None when neither was given
    patterns: list[str] = field(default_factory=list)
    matches: list[int] = field(default_factory=list)  # parameters each pattern matched here
    trainable: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)


def freeze_params(
    module: torch.nn.Module, only_train: Sequence[str] | None, freeze: Sequence[str] | None
) -> FreezeResult:
    """Set requires_grad of `module`'s parameters by the lists (slime's order: only-train, then freeze)."""
    named = list(module.named_parameters())
    flag, patterns = None, []
    if only_train:
        flag, patterns = "--only-train-params-name-list", list(only_train)
        for name, param in named:
            param.requires_grad = any(re.search(p, name) for p in patterns)
    if freeze:
        flag, patterns = "--freeze-params-name-list", list(freeze)
        for name, param in named:
            if any(re.search(p, name) for p in patterns):
                param.requires_grad = False
    result = FreezeResult(flag=flag, patterns=patterns)
    result.matches = [sum(1 for name, _ in named if re.search(p, name)) for p in patterns]
    result.trainable = [name for name, p in named if p.requires_grad]
    result.frozen = [name for name, p in named if not p.requires_grad]
    return result


def _sum_over_ranks(counts: list[int]) -> list[int]:
    if not counts or not (dist.is_available() and dist.is_initialized()):
        return counts
    from tether.train.parallel.topology import collective_device

    total = torch.tensor(counts, dtype=torch.int64, device=collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return [int(c) for c in total.tolist()]


def check_and_report(result: FreezeResult, *, report: bool, where: str = "") -> None:
    """Refuse a list that matches nothing on any rank, warn of single patterns that match nothing,
    and (when `report`) print which parameters train. Collective when a list was given."""
    if result.flag is None:
        return
    total = _sum_over_ranks(result.matches)
    if not any(total):
        raise ConfigError(
            result.flag,
            " ".join(result.patterns),
            "matches no parameter of the model (re.search on Megatron names such as "
            "'decoder.layers.0.mlp.linear_fc1.weight', 'embedding.word_embeddings.weight', 'output_layer.weight')",
        )
    if not report:
        return
    unmatched = [p for p, n in zip(result.patterns, total, strict=True) if n == 0]
    if unmatched:
        print(
            f"warning: {result.flag}: {unmatched} match no parameter on any rank", file=sys.stderr, flush=True
        )
    print(
        f"trainer{where}: {result.flag}: {len(result.trainable)} of "
        f"{len(result.trainable) + len(result.frozen)} parameters train: {result.trainable}",
        file=sys.stderr,
        flush=True,
    )


def apply_freeze(chunk: Any, algorithm: Any, *, report: bool, where: str = "") -> FreezeResult:
    """The lists of `algorithm` (an AlgorithmConfig) applied to a bare Megatron chunk, checked
    across ranks; every rank calls it."""
    result = freeze_params(chunk, algorithm.only_train_params_name_list, algorithm.freeze_params_name_list)
    check_and_report(result, report=report, where=where)
    return result

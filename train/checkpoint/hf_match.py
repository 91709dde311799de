"""Whether the actor holds exactly the weights of an HF checkpoint.

A run whose actor starts from --ref-load (or an HF --load, or a --load the head saw empty)
generates its first rollout on the engines' --hf-checkpoint weights while the trainer loads;
that rollout is kept only when the loaded weights are those very weights (`tether.run.job`).
Each exported HF tensor (`tether.train.checkpoint.export.iter_hf_weights`) is compared with the
checkpoint's tensor of the same name at the wider of their two dtypes: equal values there are
equal in whatever dtype an engine holds them, so a weight sync would change nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tether.train.checkpoint.export import iter_hf_weights
from tether.train.model.hf_config import ModelArch
from tether.train.model.hf_convert import HFWeights
from tether.train.rank.protocol import CompareHFResult


def tensor_difference(name: str, tensor: torch.Tensor, hf: HFWeights) -> str | None:
    """How `tensor` differs from the checkpoint's tensor `name`, or None when it equals it."""
    try:
        theirs = hf.get(name)
    except KeyError:
        return f"{name}: not in {hf.dir}"
    if tuple(theirs.shape) != tuple(tensor.shape):
        return f"{name}: shape {tuple(tensor.shape)} here, {tuple(theirs.shape)} in {hf.dir}"
    wide = torch.promote_types(tensor.dtype, theirs.dtype)
    ours, theirs = tensor.to(wide), theirs.to(wide)
    if torch.equal(ours, theirs):
        return None
    gap = (ours.double() - theirs.double()).abs().nan_to_num(nan=float("inf")).max().item()
    return f"{name}: values differ from {hf.dir}'s (max |difference| {gap:.3g})"


def first_difference(exported: Iterable[tuple[str, torch.Tensor]], hf: HFWeights | None) -> CompareHFResult:
    """Compares every tensor of `exported` with `hf` (None: none, this rank only takes part in
    the export's collectives) until one differs; iterates `exported` to its end either way."""
    compared, difference = 0, None
    for name, tensor in exported:
        if hf is None or difference is not None:
            continue
        try:
            difference = tensor_difference(name, tensor, hf)
        except Exception as exc:  # an unreadable shard: not known equal, and the export goes on
            difference = f"{name}: cannot read it from {hf.dir}: {exc}"
        compared += 1
    return CompareHFResult(compared=compared, difference=difference)


def compare_with_hf(chunks: list[Any], arch: ModelArch, hf_dir: str, *, compare: bool) -> CompareHFResult:
    """This rank's part of the comparison: every rank exports (collective over its TP group);
    `compare` (a stage's sync source) reads the checkpoint and compares. A checkpoint it cannot
    read (no safetensors: an engine may load .bin files) is a difference, not an error: the run
    then publishes the actor's weights as it would without the comparison."""
    hf = None
    unreadable = None
    if compare:
        try:
            hf = HFWeights(hf_dir)
        except Exception as exc:
            unreadable = f"cannot read {hf_dir} as safetensors: {exc}"
    result = first_difference(iter_hf_weights(chunks, arch), hf)
    if unreadable is not None:
        return CompareHFResult(compared=0, difference=unreadable)
    return result

"""`slime.backends.megatron_utils.cp_utils`: the context-parallel helpers that loss hooks call
(slime's examples/train_infer_mismatch_helper/mis.py imports `all_gather_with_cp` and
`slice_log_prob_with_cp`).

Under context parallelism tether hands the loss (and these hooks) every response token of a sample
on every CP rank (`tether.train.parallel.context.full_response`), not a rank's share as slime does:
gathering a sample's response over the CP group and slicing "this rank's share" of what the hook
computed both give the tensor back unchanged, and the loss stays over whole responses.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def all_gather_with_cp(tensor: T, total_length: int, response_length: int) -> T:
    """A sample's full response-token tensor from this rank's CP share: the share itself at CP size 1."""
    _check_length(tensor, response_length)
    return tensor


def slice_log_prob_with_cp(tensor: T, total_length: int, response_length: int) -> T:
    """This rank's CP share of a sample's full response-token tensor: all of it at CP size 1."""
    _check_length(tensor, response_length)
    return tensor


def _check_length(tensor: object, response_length: int) -> None:
    # A wrong length is a hook bug that slime's zigzag split would hide or crash on later; say it here.
    size = getattr(tensor, "shape", None)
    if size is not None and len(size) >= 1 and int(size[0]) != int(response_length):
        raise ValueError(f"a response tensor of {int(size[0])} tokens for response_length={response_length}")
